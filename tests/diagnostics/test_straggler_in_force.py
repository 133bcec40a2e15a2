"""With batch_shares in force the straggler report compares ranks per sample and says the
shares: a rank given more samples is not slow for taking longer, one given fewer is not fast."""

from __future__ import annotations

import pytest

from ringtrain.diagnostics import shares
from ringtrain.diagnostics.straggler import RankTimes, analyse


def _times(busy: list[float], wait: float = 0.02) -> list[RankTimes]:
    return [RankTimes(r, "ab"[r % 2], 0.01, b - 0.01, wait) for r, b in enumerate(busy)]


def test_a_rank_busy_longer_only_for_its_share_is_named_for_the_share() -> None:
    times = _times([0.3, 0.1])  # shares [3, 1]: the same time per sample on both ranks
    assumed_equal = analyse(times, in_force=None)
    assert assumed_equal.kind == "compute" and assumed_equal.ranks == (0,)  # the old verdict
    report = analyse(times, in_force=[3, 1])
    assert report.kind == "shares" and report.ranks == (0,)
    assert report.shares == (0.75, 0.25)
    first, *_, last = report.line().splitlines()
    assert first.startswith(
        "ringtrain straggler report (batch_shares in force [75, 25]): rank 0 on host a has more "
        "of each global batch than its speed: busy 0.300 s/step vs median 0.100 s, taking 75.0% "
        "of each global batch at 1.0x the median rank's time per sample"
    )
    # now: the slowest rank's 0.3 s + its 0.02 s; in proportion: 0.2 s per equal share each
    assert last == (
        "batch_shares would gain 1.45x samples/s over the shares in force [75, 25]: a step "
        "0.320 s with them, 0.220 s with shares in proportion to each rank's speed (0.220 s "
        "with equal shares); set batch_shares=[50, 50] (rank order) or 'auto'"
    )


def test_a_rank_given_fewer_samples_is_compared_per_sample() -> None:
    # Shares [1, 2, 2]: rank 0 takes 20% and is 3x slower per sample than the others.
    times = _times([0.36, 0.24, 0.24])
    report = analyse(times, in_force=[1, 2, 2])
    assert report.kind == "compute" and report.ranks == (0,)
    line = report.line()
    assert "(batch_shares in force [20, 40, 40])" in line
    # compute 0.35 s for 20%: 0.583 s for a third, vs 0.23 s for 40%: 0.192 s (1.5x as measured)
    assert "compute 0.583 s per equal share vs median 0.192 s (3.0x) (it takes 20.0%" in line
    gain = shares.predict([0.36, 0.24, 0.24], 0.02, [1, 2, 2])
    assert gain.now_step_s == pytest.approx(0.38)
    assert gain.equal_step_s == pytest.approx(0.6 + 0.02)  # 0.36 s for 20% -> 0.6 s for a third
    assert gain.shared_step_s == pytest.approx(3 / (1 / 0.6 + 10) + 0.02)
    assert gain.shares == (14, 43, 43) and gain.gain == pytest.approx(0.38 / gain.shared_step_s)
    assert line.splitlines()[-1] == gain.line()


def test_shares_in_proportion_are_balanced_and_said() -> None:
    report = analyse(_times([0.2, 0.2]), in_force=[2, 1])  # rank 1 at half speed, half the work
    assert report.kind == "none"
    assert report.line().startswith(
        "ringtrain straggler report (batch_shares in force [67, 33]): ranks are balanced"
    )
    assert (
        analyse(_times([0.2, 0.4]), in_force=[1, 1])
        .line()
        .startswith(  # equal: not said
            "ringtrain straggler report: rank 1 on host b is compute-bound"
        )
    )


def test_the_engines_record_gives_the_mean_shares_of_the_window() -> None:
    record = shares.InForce()
    assert record.take() is None  # no step
    for step in range(4):
        record.add([3, 1] if step < 2 else None, 2)
    assert record.take() == pytest.approx((0.625, 0.375))
    assert record.take() is None  # a new window
    record.add([1, 1], 2)
    assert record.take() is None  # equal throughout
    record.add([3, 1], 2)
    record.add([1, 1, 2], 3)  # an elastic change: the window starts again
    record.add([5, 1], 3)  # not this world's: left out
    assert record.take() == pytest.approx((0.25, 0.25, 0.5))
    record.add([3, 1], 2)
    report = analyse(_times([0.3, 0.1]), in_force=record)
    assert report.kind == "shares" and record.take() is None  # taken by the report
    assert analyse(_times([0.3, 0.1]), in_force=[1, 1, 1]).shares is None  # not one per rank
