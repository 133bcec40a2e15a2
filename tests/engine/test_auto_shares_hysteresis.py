"""batch_shares="auto" on a busy machine: noise within the margin moves nothing, a real change
moves the shares once (two ranks simulated in one process, rates injected)."""

from __future__ import annotations

import logging

import pytest

from ringtrain.engine.auto_shares import (
    CONFIRM,
    GAIN_MARGIN,
    MEASURE_STEPS,
    WARMUP_STEPS,
    AutoShares,
    predicted_gain,
    shares_for,
)


class Ranks:
    """Two AutoShares fed the same agreed rates, one measurement at a time."""

    def __init__(self) -> None:
        self.rates: list[float] = []
        self.autos = [AutoShares(2, r, self._agree, clock=lambda: 1.0) for r in range(2)]
        self.changes: list[tuple[int, ...]] = []
        for _ in range(1 + WARMUP_STEPS):  # the first step and the warm-up measure nothing
            self._step()

    def _agree(self, vector: list[float]) -> list[float]:
        return list(self.rates)  # what the allreduce of every rank's rate gives

    def _step(self) -> None:
        got = [a.observe(a._last_end + 0.01, a._last_end + 0.02) for a in self.autos]
        assert got[0] == got[1]  # every rank alike, at the same step
        if got[0] is not None:
            self.changes.append(got[0])

    def measure(self, rates: list[float]) -> tuple[int, ...]:
        """One measurement at these rates (samples/s of each rank); the shares then in force."""
        self.rates = rates
        for _ in range(MEASURE_STEPS):
            self._step()
        assert self.autos[0].shares == self.autos[1].shares
        return self.autos[0].shares


def test_the_predicted_gain_is_the_slowest_ranks_busy_time_over_the_new_one() -> None:
    assert predicted_gain([1, 1], [2, 1], [2.0, 1.0]) == pytest.approx(1.5)
    assert predicted_gain([2, 1], [2, 1], [2.0, 1.0]) == pytest.approx(1.0)
    assert predicted_gain([2, 1], [1, 1], [2.0, 1.0]) == pytest.approx(2 / 3)


def test_noise_within_the_margin_moves_nothing(caplog: pytest.LogCaptureFixture) -> None:
    ranks = Ranks()
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        first = ranks.measure([300.0, 100.0])  # rank 1 at a third of rank 0's speed
    assert first == shares_for([300.0, 100.0]) == (750, 250)
    said = [r.getMessage() for r in caplog.records if r.name == "ringtrain"]
    assert len(said) == 1 and f"over {GAIN_MARGIN:.0%} at {CONFIRM} measurements" in said[0]
    # A busy machine: each measurement off by up to 8% per rank, in either direction.
    noisy = [[324.0, 100.0], [300.0, 92.0], [276.0, 108.0], [300.0, 100.0], [300.0, 108.0]]
    for rates in noisy:
        assert predicted_gain(first, shares_for(rates), rates) < 1 + GAIN_MARGIN
        assert ranks.measure(rates) == first
    # Past the margin once, then back: one measurement alone moves nothing.
    for _ in range(3):
        assert ranks.measure([300.0, 200.0]) == first
        assert ranks.measure([300.0, 100.0]) == first
    # Past the margin twice in a row, but in opposite directions: nothing.
    assert ranks.measure([300.0, 200.0]) == first
    assert ranks.measure([600.0, 100.0]) == first
    # Every rank slower alike: no rank's share of the work changes.
    assert ranks.measure([150.0, 50.0]) == first
    assert ranks.measure([150.0, 50.0]) == first
    assert ranks.changes == [first]


def test_a_real_change_moves_the_shares_once(caplog: pytest.LogCaptureFixture) -> None:
    ranks = Ranks()
    first = ranks.measure([300.0, 100.0])
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        caplog.clear()
        assert ranks.measure([300.0, 300.0]) == first  # rank 1's neighbour left: once, wait
        moved = ranks.measure([310.0, 290.0])  # and again: the change is taken
        for _ in range(4):  # and kept
            assert ranks.measure([300.0, 300.0]) == moved
    assert moved == shares_for([305.0, 295.0])  # the mean of the two measurements
    assert ranks.changes == [first, moved]
    said = [r for r in caplog.records if r.name == "ringtrain"]
    assert [r.levelno for r in said] == [logging.INFO]  # the change, once, from rank 0
    assert said[0].getMessage().startswith(f"ringtrain batch_shares=auto: shares {list(moved)}")


def test_ranks_even_in_speed_keep_equal_shares() -> None:
    ranks = Ranks()
    assert ranks.measure([100.0, 95.0]) == (1, 1)  # would gain 2.5%: under the margin
    assert ranks.changes == []


def _times(shares: tuple[int, ...], fixed: float, per_batch: list[float]) -> list[float]:
    """Seconds per step of each rank: a fixed part (the optimizer, the Python around the model)
    plus its share of the global batch at its own speed."""
    whole = sum(shares)
    return [fixed + b * s / whole for s, b in zip(shares, per_batch)]


def test_a_rank_left_with_a_tiny_share_gets_its_part_back() -> None:
    # Rank 1 at half speed, 3 ms of every step fixed. One noisy first measurement (rank 1 seen
    # 99 times slower) leaves it 1% of the batch; per sample it then looks 4 times slower than
    # it is (3.2 ms for 1%), and the gain of giving it more was predicted at 3%: the shares
    # stayed there, rank 1 idle three quarters of each step, no faster than equal shares.
    fixed, per_batch = 0.003, [0.010, 0.020]
    ranks = Ranks()
    shares = ranks.measure([990.0, 10.0])
    assert shares == (990, 10)
    for _ in range(12):
        times = _times(shares, fixed, per_batch)
        shares = ranks.measure([s / t for s, t in zip(shares, times)])
    best = fixed + per_batch[0] * per_batch[1] / sum(per_batch)  # both ranks busy alike
    step = max(_times(shares, fixed, per_batch))
    assert step < 1.05 * best, (shares, step, best)
    assert 280 < shares[1] < 360  # about a third, where both take as long
    # And there it stays: the times balanced within the margin move nothing.
    for _ in range(4):
        times = _times(shares, fixed, per_batch)
        assert ranks.measure([s / t for s, t in zip(shares, times)]) == shares
