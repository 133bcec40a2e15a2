"""compression="auto" / sync_every="auto" measuring a slow link without holding it (issue 40).

The tuner (:class:`ringtrain.engine.auto.AutoTuner`) on injected figures, in one process: its
probe and its agreement over ranks (the MAX allreduce) are replaced, so each test says what the
slowest rank measured and counts the steps and probes the tuner spends. That every rank reaches
the same decision from MAX-agreed figures is tests/compression/test_policy.py's, on real ranks.
"""

from __future__ import annotations

from typing import Any

import pytest

from _plans import plan_of
from ringtrain.compression.policy import AutoCompression
from ringtrain.config import Config
from ringtrain.engine import auto
from ringtrain.engine.auto import PROBE_BYTES, PROBE_MIN_BYTES, PROBE_SECONDS, probe_bytes

MBIT = 1e6 / 8  # bytes per second of one Mbit/s


# ---- the throughput probe's size: a time, not the gradients' bytes (pure) ----------------------


def test_the_probe_takes_about_its_time_at_the_estimated_rate() -> None:
    rate = 10 * MBIT
    nbytes = probe_bytes(64 << 20, rate)
    assert nbytes == pytest.approx(rate * PROBE_SECONDS, abs=4)
    assert nbytes % 4 == 0  # whole float32 elements


@pytest.mark.parametrize("rate", [1.0, 1e3, 10e3])
def test_a_very_slow_link_still_gets_the_fewest_bytes(rate: float) -> None:
    assert probe_bytes(64 << 20, rate) == PROBE_MIN_BYTES


@pytest.mark.parametrize(("grad_bytes", "most"), [(64 << 20, PROBE_BYTES), (3 << 20, 3 << 20)])
def test_a_fast_link_gets_todays_bound(grad_bytes: int, most: int) -> None:
    # The gradients' bytes up to 8 MiB: what every probe was before the estimate.
    assert probe_bytes(grad_bytes, 10e9) == most
    assert probe_bytes(grad_bytes, None) == most
    assert probe_bytes(grad_bytes, float("inf")) == most


def test_tiny_gradients_are_probed_with_the_fewest_bytes() -> None:
    assert probe_bytes(3000, 1e9) == probe_bytes(3000, None) == PROBE_MIN_BYTES


def test_the_size_grows_with_the_rate_between_its_bounds() -> None:
    sizes = [probe_bytes(64 << 20, mbit * MBIT) for mbit in (1, 10, 100, 1000, 10000)]
    assert sizes == sorted(sizes)
    assert sizes[0] == PROBE_MIN_BYTES and sizes[-1] == PROBE_BYTES
    assert PROBE_MIN_BYTES < sizes[1] < sizes[2] < PROBE_BYTES


class ShapedLink:
    """An allreduce's seconds on a link shaped by a token bucket: ``burst`` bytes at once, the
    rest at ``rate`` (tc tbf's shape), plus ``latency``; ``noise`` multiplies the n-th probe's
    time (1.0 after the list)."""

    def __init__(
        self, rate: float, burst: int = 16384, latency: float = 0.001, noise: tuple = ()
    ) -> None:
        self.rate, self.burst, self.latency, self.noise = rate, burst, latency, noise
        self.sizes: list[int] = []

    def timed(self, nbytes: int) -> float:
        n = len(self.sizes)
        self.sizes.append(nbytes)
        scale = self.noise[n] if n < len(self.noise) else 1.0
        return (self.latency + max(0, nbytes - self.burst) / self.rate) * scale


def test_a_steady_link_is_probed_twice_each_sized_by_the_last_rate() -> None:
    # 10 Mbit/s; the first small probe rode the burst and guessed twice the rate.
    link = ShapedLink(10 * MBIT)
    rate = auto.throughput(link.timed, 64 << 20, 20 * MBIT, link.latency)
    assert len(link.sizes) == 2  # two in a row agree: no third
    assert link.sizes[0] == probe_bytes(64 << 20, 20 * MBIT)  # ~0.5 s at the true rate
    # The second is sized by the first's measurement: about PROBE_SECONDS at the true rate.
    assert link.sizes[1] / (10 * MBIT) == pytest.approx(PROBE_SECONDS, rel=0.12)
    assert rate == pytest.approx(10 * MBIT, rel=0.12)


def test_a_noisy_link_is_probed_up_to_three_times_and_the_best_rate_counts() -> None:
    link = ShapedLink(10 * MBIT, noise=(1.0, 2.0, 1.0))  # the second probe shared the link
    rate = auto.throughput(link.timed, 64 << 20, 10 * MBIT, link.latency)
    assert len(link.sizes) == auto.THROUGHPUT_PROBES == 3
    # The slow second probe does not shrink the third (sized by the best rate so far), which
    # would ride the shaper's burst and overestimate the link.
    assert link.sizes[2] == link.sizes[1]
    assert rate == pytest.approx(10 * MBIT, rel=0.12)


def test_a_link_too_fast_to_size_by_time_keeps_the_bound_and_stops_at_two() -> None:
    link = ShapedLink(1e10, latency=0.0001)
    auto.throughput(link.timed, 3 << 20, 1e10, link.latency)
    assert link.sizes == [3 << 20, 3 << 20]


def test_the_rate_a_step_implies() -> None:
    # 4.4 MB in a step that waited 3.5 s with buckets in flight 3.4 s: the longer time counts.
    assert auto.step_rate(4_400_000, 3.4, 3.5) == pytest.approx(4_400_000 / 3.5)
    assert auto.step_rate(4_400_000, 0.0, 0.0) is None
    assert auto.step_rate(0, 1.0, 1.0) is None


# ---- the tuner, on injected figures -------------------------------------------------------------


# A 1.1M-parameter MLP (4.4 MB of float32 gradients), as issue 40's 10 Mbit/s run.
MLP = plan_of(((1024, 512), (512,), (1024, 512), (512,), (64, 512)))
MLP_BYTES = sum(b.nbytes for b in MLP.buckets)


class Recorder:
    """The injected probe and agreement: what the tuner asked for."""

    def __init__(self, latency_s: float, bytes_per_s: float) -> None:
        self.link = (latency_s, bytes_per_s)
        self.probes: list[tuple[int, float | None]] = []
        self.agreements = 0

    def probe(self, grad_bytes: int, estimate: float | None) -> tuple[float, float]:
        self.probes.append((grad_bytes, estimate))
        return self.link

    def agree(self, values: list[float]) -> list[float]:
        self.agreements += 1
        return values  # one rank: its own figures are the slowest


def tuner_of(recorder: Recorder, config: Config | None = None, **kw: Any) -> auto.AutoTuner:
    return auto.AutoTuner(
        AutoCompression(config or Config()),
        None,
        2,
        0,
        probe=recorder.probe,
        agree=recorder.agree,
        **kw,
    )


def observe_until_decided(
    tuner: auto.AutoTuner, compute_s: float, wait_s: float, most: int = 20
) -> int:
    """Observe uncompressed steps of these figures until the tuner decides (a tentative choice
    or settled); the number of observe() calls."""
    for n in range(1, most + 1):
        tuner.observe(compute_s, wait_s, wait_s, MLP)
        if tuner.measurement is not None:
            return n
    raise AssertionError(f"no decision after {most} steps")


def test_the_tuner_sizes_its_probe_by_the_rate_the_steps_imply() -> None:
    rec = Recorder(0.002, 10 * MBIT)
    tuner = tuner_of(rec)
    observe_until_decided(tuner, 0.8, 0.2)  # compute-bound: the full measurement
    ((grad_bytes, estimate),) = rec.probes
    assert grad_bytes == MLP_BYTES
    assert estimate == pytest.approx(MLP_BYTES / 0.2)  # the MAX-agreed wait and comm


def _probe_both_ways() -> list[float]:
    """probe_link on real ranks: with the rate left to its first small probe, and given."""
    import ringtrain as rt
    from ringtrain.runtime import state

    group = state.current().world.communicator.group("engine")
    first = auto.probe_link(group, 4 << 20)
    given = auto.probe_link(group, 4 << 20, 40 * MBIT)
    rt.barrier()
    return [*first, *given]


def test_probe_link_runs_alike_on_every_rank(world2: Any) -> None:
    # Collective: a size that differed between the ranks would hang or fail here.
    for figures in world2.run(_probe_both_ways, timeout=60):
        assert all(f > 0 for f in figures), figures


# ---- an early decision where the link clearly dominates -----------------------------------------


def test_a_link_bound_step_decides_after_one_warmup_and_one_measured_step() -> None:
    # Issue 40's MLP at 10 Mbit/s: ~10 ms of compute, ~3.5 s waiting for 4.4 MB.
    rec = Recorder(0.002, 10 * MBIT)
    tuner = tuner_of(rec)
    assert observe_until_decided(tuner, 0.01, 3.5) == 2
    assert rec.agreements == 2  # the checked step's figures, then the probe's
    ((_, estimate),) = rec.probes
    assert estimate == pytest.approx(MLP_BYTES / 3.5)
    # About PROBE_SECONDS a probe at that rate, not 4.4 MB (~3.5 s) each.
    assert probe_bytes(MLP_BYTES, estimate) < MLP_BYTES / 10
    m = tuner.measurement
    assert m is not None and (m.compute_s, m.wait_s) == pytest.approx((0.01, 3.5))


@pytest.mark.parametrize(("compute_s", "wait_s"), [(0.8, 0.2), (0.1, 0.1), (0.1, 0.39)])
def test_a_step_not_clearly_link_bound_is_measured_as_before(
    compute_s: float, wait_s: float
) -> None:
    # Waiting under LINK_BOUND_WAIT_RATIO times the compute: the two warm-up steps and the
    # four measured ones, as before the early decision.
    assert wait_s < auto.LINK_BOUND_WAIT_RATIO * compute_s
    rec = Recorder(0.002, 10 * MBIT)
    tuner = tuner_of(rec)
    assert observe_until_decided(tuner, compute_s, wait_s) == (
        auto.WARMUP_STEPS + auto.MEASURE_STEPS
    )
    assert len(rec.probes) == 1


def test_the_checked_warmup_step_does_not_enter_the_measurement() -> None:
    # Not link-bound: the measurement is the median of the MEASURE_STEPS steps after the
    # warm-up, as before; the slower warm-up steps do not count.
    tuner = tuner_of(Recorder(0.002, 10 * MBIT))
    for _ in range(auto.WARMUP_STEPS):
        tuner.observe(0.3, 0.3, 0.3, MLP)
    for wait in (0.1, 0.2, 0.2, 0.1)[: auto.MEASURE_STEPS]:
        tuner.observe(0.5, wait, wait, MLP)
    m = tuner.measurement
    assert m is not None
    assert m.wait_s == pytest.approx(0.15) and m.compute_s == pytest.approx(0.5)


def test_the_link_bound_rule() -> None:
    ratio = auto.LINK_BOUND_WAIT_RATIO
    assert auto.link_bound(auto.SlowestStep(1 + ratio, ratio, ratio, True, ratio))
    assert not auto.link_bound(auto.SlowestStep(1 + ratio * 0.9, ratio * 0.9, 0, True, ratio * 0.9))
    assert not auto.link_bound(auto.SlowestStep(0.0, 0.0, 0.0, True, 0.0))  # nothing measured
    # A straggler: rank 0 computed 1 ms and waited 5 ms for rank 1, which computed 6 ms and
    # waited 0.1 ms. The slowest figures alone would look link-bound; the least wait does not.
    step = auto.SlowestStep(0.0061, 0.005, 0.005, True, 0.0001)
    assert step.wait_s >= ratio * step.compute_s and not auto.link_bound(step)
    # Far below SYNC_EFFICIENCY: more samples could not bring the step near it.
    assert 1 / (1 + ratio) <= auto.SYNC_EFFICIENCY / 4
