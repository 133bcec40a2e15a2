"""Driving ``compression="auto"`` for one DistributedOptimizer: measure, decide, try, keep.

Phases, counted in steps after the learning step (which sends everything at ``step()`` and so
says nothing about overlap):

1. **measure** (:data:`MEASURE_STEPS` uncompressed steps, after :data:`WARMUP_STEPS` whose
   allocations and caches make them slow): per step, the time outside ``synchronize()``
   (compute), the time inside it (waiting for the exchange) and the time some bucket allreduce
   was in flight, agreed by one allreduce (MAX) so every rank holds the slowest rank's. The
   last warm-up step is agreed alone first: where every rank waited
   :data:`LINK_BOUND_WAIT_RATIO` times the compute or more (:func:`link_bound`: a slow link),
   it is the measurement, and the decision comes after one warm-up step and that one. Then a
   probe (:func:`probe_link`): tiny allreduces (latency) and a few allreduces sized by time
   (:func:`probe_bytes`: about :data:`PROBE_SECONDS` each at the rate the measured steps imply,
   so a slow link is not held for seconds), agreed by a second MAX allreduce; every rank then
   calls the pure :func:`ringtrain.compression.policy.choose` on identical numbers and reaches
   the same decision without a further message.
2. **try** the chosen method (if not ``none``) for :data:`MEASURE_STEPS` steps, after its own
   warm-up (PowerSGD's remaining start steps), and keep it only if the slowest rank's median
   step is :data:`~ringtrain.compression.policy.KEEP_MARGIN` shorter than uncompressed
   (:func:`~ringtrain.compression.policy.keep`, on MAX-allreduced figures again). Otherwise go
   back to ``none``: a fast link is never made slower for more than those few steps.
3. **done**: rank 0 logs the decision and why, once.

All collectives here run on the engine group at the end of ``synchronize()``, after every bucket
is finished, at the same step on every rank.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ringtrain.compression import policy
from ringtrain.compression.policy import AutoCompression, Decision, Measurement
from ringtrain.compression.powersgd import make_layout
from ringtrain.engine import local_policy
from ringtrain.engine.buckets import Plan
from ringtrain.host import cpu_limits
from ringtrain.transport import group_ops

log = logging.getLogger("ringtrain")

WARMUP_STEPS = 2
MEASURE_STEPS = 4
LATENCY_PROBES = 5
THROUGHPUT_PROBES = 3
PROBE_BYTES = 8 << 20  # a throughput probe's most bytes (and never more than the gradients)
PROBE_MIN_BYTES = 64 << 10  # and its fewest: below this a probe times latency, not throughput
# Each throughput probe is sized to take about this long at the estimated rate: long enough to
# time a link's throughput (a shaper's burst, 10 ms at its rate, is under a tenth of it), short
# enough that the probes cost a slow link about half a second once (at 10 Mbit/s, 8 MiB took
# ~3.5 s each; 0.25 s probes, ~1 s: 10% of issue 40's 10-second tasks).
PROBE_SECONDS = 0.15
# The throughput probes stop once two in a row measure rates this close (relative to the larger):
# a steady link takes two, not THROUGHPUT_PROBES.
PROBE_AGREE = 0.1


class SlowestStep(NamedTuple):
    """A measured step's figures, the slowest rank's (MAX-allreduced: alike on every rank)."""

    step_s: float
    wait_s: float
    comm_s: float
    spare_core: bool  # every rank has a core beyond its torch threads
    least_wait_s: float  # the wait of the rank that waited least (a straggler waits least)

    @property
    def compute_s(self) -> float:
        return self.step_s - self.wait_s


# A step that waits this many times its compute runs at <= 1/(1+4) = 20% of the compute speed
# uncompressed: more samples would need a 16x shorter wait to reach SYNC_EFFICIENCY, so one decides.
LINK_BOUND_WAIT_RATIO = 4.0


def link_bound(step: SlowestStep) -> bool:
    """Whether every rank's step waited at least :data:`LINK_BOUND_WAIT_RATIO` times the
    (slowest rank's) compute: the link clearly dominates, and one measured step is enough. A
    rank that waited for a straggler (a busy or preempted peer) does not count: the straggler
    itself waits little. Pure."""
    return step.least_wait_s > 0 and step.least_wait_s >= LINK_BOUND_WAIT_RATIO * step.compute_s


class AutoTuner:
    """The measurement state of one optimizer using :class:`AutoCompression`."""

    def __init__(
        self,
        auto: AutoCompression,
        group: Any,
        size: int,
        rank: int,
        probe: Callable[[int, float | None], tuple[float, float]] | None = None,
        agree: Callable[[list[float]], list[float]] | None = None,
    ) -> None:
        """``probe(grad_bytes, bytes_per_s) -> (latency_s, bytes_per_s)`` replaces the link probe
        (:func:`probe_link`) and ``agree(values) -> values`` the MAX allreduce over ranks
        (:func:`slowest`): tests inject figures."""
        self.auto = auto
        self._probe = probe or self._probe_link
        self._agree = agree or self._slowest
        self._group = group
        self._size = size
        self._rank = rank
        self.phase = "done" if auto.settled else "measure"
        self._samples: list[tuple[float, float, float]] = []
        self._skip = WARMUP_STEPS - 1  # steps to let pass before timing (the last is checked)
        self._last_warmup_checked = False
        self._steps = 0  # steps observed so far
        self._baseline_s = 0.0
        self.measurement: Measurement | None = None
        self.tentative: Decision | None = None

    @property
    def active(self) -> bool:
        """Still measuring (the exchange should note completion times)."""
        return self.phase != "done"

    def restored(self) -> None:
        """The AutoCompression was loaded from a checkpoint: stop measuring."""
        if self.auto.settled:
            self.phase = "done"

    def observe(self, compute_s: float, wait_s: float, comm_s: float, plan: Plan) -> bool:
        """One finished (non-learning) step. Returns True when the compressor changed, so the
        caller rebuilds its exchange. Collective at the end of a phase."""
        self._steps += 1
        if self.phase == "done":
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        if self.phase == "measure" and not self._last_warmup_checked:
            return self._last_warmup_step((compute_s, wait_s, comm_s), plan)
        self._samples.append((compute_s, wait_s, comm_s))
        if len(self._samples) < MEASURE_STEPS:
            return False
        samples, self._samples = self._samples, []
        if self.phase == "measure":
            return self._decide(self._slowest_step(samples), plan)
        return self._confirm(samples)

    # ---- phases --------------------------------------------------------------------------------

    def _last_warmup_step(self, sample: tuple[float, float, float], plan: Plan) -> bool:
        """The last warm-up step, agreed over ranks (collective): where the link clearly
        dominates it (:func:`link_bound`), it is the measurement and the decision comes now;
        otherwise it stays a warm-up step and :data:`MEASURE_STEPS` more are timed."""
        self._last_warmup_checked = True
        slowest = self._slowest_step([sample])
        if link_bound(slowest):
            return self._decide(slowest, plan)
        return False

    def _slowest_step(self, samples: list[tuple[float, float, float]]) -> SlowestStep:
        """The samples' medians, the slowest rank's (collective). A spare core counts only if
        every rank has one: MAX of its absence; the least wait is MAX of its negation."""
        _, wait, comm = (statistics.median(col) for col in zip(*samples))
        step = statistics.median(c + w for c, w, _ in samples)
        step, wait, comm, no_spare, minus_wait = self._agree(
            [step, wait, comm, float(not _spare_core()), -wait]
        )
        return SlowestStep(step, wait, comm, not no_spare, -minus_wait)

    def _decide(self, slowest: SlowestStep, plan: Plan) -> bool:
        grad_bytes = sum(b.nbytes for b in plan.buckets)
        # The probe's size comes from figures every rank holds alike: the same on every rank.
        estimate = step_rate(grad_bytes, slowest.comm_s, slowest.wait_s)
        latency, throughput = self._probe(grad_bytes, estimate)
        # Throughput: the slowest rank's is the smallest: MAX of its inverse.
        latency, inverse = self._agree([latency, 1.0 / throughput])
        self.measurement = m = _measurement(
            plan,
            self.auto,
            self._size,
            slowest.compute_s,
            slowest.wait_s,
            slowest.comm_s,
            latency,
            1.0 / inverse,
            spare_core=slowest.spare_core,
        )
        self._baseline_s = slowest.step_s
        decision = policy.choose(m)
        if decision.compression == "none":
            self._finish(decision)
            return False
        self.tentative = decision
        overrides: dict[str, Any] = {}
        self._skip = 1  # the first step after the switch also rebuilds buffers
        if decision.compression == "powersgd" and self.auto.config is not None:
            # The measured steps count as PowerSGD's uncompressed start.
            start = max(0, self.auto.config.powersgd_start_step - self._steps - 1)
            overrides["powersgd_start_step"] = start
            self._skip += start
        self.auto.use(decision.compression, **overrides)
        self.phase = "try"
        return True

    def _confirm(self, samples: list[tuple[float, float, float]]) -> bool:
        (tried,) = self._agree([statistics.median(c + w for c, w, _ in samples)])
        decision = self.tentative
        assert decision is not None
        verdict = (
            f" Tried: {tried * 1e3:.1f} ms per step against {self._baseline_s * 1e3:.1f} ms "
            "uncompressed"
        )
        waited = self.measurement.wait_s if self.measurement is not None else math.inf
        if policy.keep(self._baseline_s, tried, waited):
            self._finish(
                Decision(
                    decision.compression,
                    decision.backward_passes_per_step,
                    decision.reason + verdict + ": kept.",
                    decision.predicted_step_s,
                )
            )
            return False
        self.auto.use("none")
        self._finish(
            Decision(
                "none",
                decision.backward_passes_per_step,
                decision.reason
                + verdict
                + f" ({waited * 1e3:.1f} ms of which waited for the exchange, all that "
                f"compression can save): not {policy.KEEP_MARGIN:.0%} faster, so none.",
                decision.predicted_step_s,
            )
        )
        return True

    def _finish(self, decision: Decision) -> None:
        if decision.compression == "none":
            self.auto.use("none")
        self.auto.settle(decision)
        self.phase = "done"
        if self._rank == 0:
            log.warning(
                "ringtrain compression=auto chose %s: %s", decision.compression, decision.reason
            )

    # ---- collectives -----------------------------------------------------------------------------

    def _probe_link(self, grad_bytes: int, bytes_per_s: float | None) -> tuple[float, float]:
        return probe_link(self._group, grad_bytes, bytes_per_s)

    def _slowest(self, values: list[float]) -> list[float]:
        return slowest(self._group, values)


def probe_link(
    group: Any, grad_bytes: int, bytes_per_s: float | None = None
) -> tuple[float, float]:
    """(seconds of a tiny allreduce, bytes per second of larger ones), on ``group``
    (collective: every rank calls it at the same point), the slowest rank's figures. The first
    larger allreduce is :func:`probe_bytes` of ``grad_bytes`` at the rate ``bytes_per_s``, which
    must be the same on every rank (figures already MAX-allreduced); None: one allreduce of
    :data:`PROBE_MIN_BYTES` first estimates the rate. Then :func:`throughput`."""
    (latency,) = slowest(group, [_fastest(group, torch.zeros(1), LATENCY_PROBES)])
    if bytes_per_s is None:
        bytes_per_s = _first_rate(group, latency)

    def timed(nbytes: int) -> float:
        (took,) = slowest(group, [_fastest(group, torch.zeros(nbytes // 4), 1)])
        return took

    return latency, throughput(timed, grad_bytes, bytes_per_s, latency)


def throughput(
    timed: Callable[[int], float], grad_bytes: int, bytes_per_s: float, latency_s: float
) -> float:
    """A link's bytes per second from up to :data:`THROUGHPUT_PROBES` allreduces, the first of
    :func:`probe_bytes` at ``bytes_per_s``, each later one at the best rate measured so far: a
    rough first estimate sizes one probe only (a 64 KiB allreduce rides a shaper's burst and
    overestimates a slow link, which made every probe take twice its time), and a probe that
    met congestion does not shrink the next (a short probe rides the burst again). They stop
    once two in a row agree within :data:`PROBE_AGREE`; the best rate counts. ``timed(nbytes)``:
    the seconds of one allreduce of ``nbytes``, agreed over ranks, so every rank sizes and stops
    alike."""
    rates: list[float] = []
    for _ in range(THROUGHPUT_PROBES):
        nbytes = probe_bytes(grad_bytes, max(rates) if rates else bytes_per_s)
        rates.append(_rate(nbytes, timed(nbytes), latency_s))
        if len(rates) > 1 and abs(rates[-1] - rates[-2]) <= PROBE_AGREE * max(rates[-2:]):
            break
    return max(rates)


def probe_bytes(grad_bytes: int, bytes_per_s: float | None) -> int:
    """A throughput probe's bytes: what ``bytes_per_s`` moves in :data:`PROBE_SECONDS`, within
    [:data:`PROBE_MIN_BYTES`, the gradients' bytes up to :data:`PROBE_BYTES`] (that bound alone
    without a usable rate), in whole float32 elements. Pure: equal figures, equal size."""
    most = max(PROBE_MIN_BYTES, min(grad_bytes, PROBE_BYTES))
    if bytes_per_s is None or not (bytes_per_s > 0 and math.isfinite(bytes_per_s)):
        return most // 4 * 4
    return max(PROBE_MIN_BYTES, min(most, int(bytes_per_s * PROBE_SECONDS))) // 4 * 4


def step_rate(grad_bytes: int, comm_s: float, wait_s: float) -> float | None:
    """The rate a measured step implies: its gradients' bytes over the longer of the time some
    bucket was in flight and the time it waited (an underestimate: a shorter probe, never a
    longer one); None when neither was timed. Pure."""
    took = max(comm_s, wait_s)
    return grad_bytes / took if grad_bytes > 0 and took > 0 else None


def _first_rate(group: Any, latency: float) -> float:
    """A rough rate every rank agrees on: one allreduce of :data:`PROBE_MIN_BYTES`, timed on
    every rank, the slowest rank's time MAX-allreduced (collective; ``latency``: agreed)."""
    (took,) = slowest(group, [_fastest(group, torch.zeros(PROBE_MIN_BYTES // 4), 1)])
    return _rate(PROBE_MIN_BYTES, took, latency)


def _fastest(group: Any, tensor: torch.Tensor, times: int) -> float:
    """The shortest of ``times`` allreduces of ``tensor`` on ``group`` (collective)."""
    fastest = float("inf")
    for _ in range(times):
        t0 = time.perf_counter()
        group_ops.allreduce(tensor, group)
        fastest = min(fastest, time.perf_counter() - t0)
    return fastest


def _rate(nbytes: int, took_s: float, latency_s: float) -> float:
    """Bytes per second of an allreduce of ``nbytes`` that took ``took_s``, its latency taken
    off. A link too fast to time gets a floor of 1 ns per byte."""
    return nbytes / max(took_s - latency_s, nbytes * 1e-9)


def slowest(group: Any, values: list[float]) -> list[float]:
    """Every rank's values, MAX over ranks: identical on every rank afterwards."""
    t = torch.tensor(values, dtype=torch.float64)
    group_ops.allreduce(t, group, op="max")
    return [float(v) for v in t.tolist()]


def _spare_core() -> bool:
    """Whether this rank may run on more cores than torch's threads use (a reducer thread can
    then work beside backward)."""
    return cpu_limits.usable_cpus() > torch.get_num_threads()  # affinity, capped by cgroup quota


def _measurement(
    plan: Plan,
    auto: AutoCompression,
    size: int,
    compute: float,
    wait: float,
    comm: float,
    latency: float,
    throughput: float,
    spare_core: bool = True,
) -> Measurement:
    """The policy's input: the measured times plus what the plan says about the bytes."""
    config = auto.config
    rank = config.powersgd_rank if config is not None else 2
    ratio = config.topk_ratio if config is not None else 0.01
    numel = sum(b.numel for b in plan.buckets)
    nbytes = sum(b.nbytes for b in plan.buckets)
    wire, collectives = 0, 0
    for b in plan.buckets:
        lay = make_layout(b.shapes, b.numel, rank, 2.0)
        wire += lay.wire_numel
        collectives += 2 if lay.matrices else (1 if lay.plain else 0)
    return Measurement(
        world_size=size,
        grad_bytes=nbytes,
        grad_numel=numel,
        element_size=nbytes // numel if numel else 4,
        buckets=len(plan.buckets),
        compute_s=compute,
        wait_s=wait,
        comm_s=comm,
        latency_s=latency,
        bytes_per_s=throughput,
        powersgd_wire_numel=wire,
        powersgd_collectives=collectives,
        topk_ratio=ratio,
        on_cuda=any(b.device.startswith("cuda") for b in plan.buckets),
        spare_core=spare_core,
    )


# ---- sync_every="auto": local updates where synchronous training cannot keep up ----------------

# Synchronous training (its best compression) predicted under this share of the compute speed
# makes local updates worth their change to the optimisation.
SYNC_EFFICIENCY = 0.8
# Local updates' outer exchange and H: ringtrain.engine.local_policy (pure, tested alone).
SYNC_EVERY_CHOICES = local_policy.SYNC_EVERY_CHOICES


def outer_exchange_s(m: Measurement, codec: str = local_policy.DEFAULT_CODEC) -> float:
    """Predicted seconds of one outer exchange with ``codec``: the weights on the wire at the
    step's measured rate, averaged as an allreduce, plus a few collectives' overhead."""
    return local_policy.exchange_s(m.grad_numel, codec, m.in_step_bytes_per_s, m.op_overhead_s)


def choose_sync_every(
    m: Measurement,
    predicted_step_s: dict[str, float],
    given: local_policy.Given = local_policy.NOT_GIVEN,
) -> tuple[int, str]:
    """(sync_every, why): 0 (synchronous) unless the best synchronous method is predicted under
    :data:`SYNC_EFFICIENCY` of the compute speed; else the H of
    :func:`ringtrain.engine.local_policy.choose_local` (the least predicted time to target,
    the exchange's cost and H's cost in steps weighed), predicted with the user's outer
    settings ``given``. Pure: equal figures, equal answer."""
    if m.world_size <= 1 or m.compute_s <= 0:
        return 0, "one rank or no compute measured: synchronous."
    sync = {k: v for k, v in predicted_step_s.items() if k in ("none", "fp16", "powersgd")}
    sync = sync or {"none": m.step_s}
    best = min(sync, key=lambda k: sync[k])
    efficiency = m.compute_s / max(sync[best], m.compute_s)
    head = (
        f"synchronous training is predicted at {efficiency:.0%} of the compute speed (best: "
        f"{best}, {sync[best] * 1e3:.0f} ms per step for {m.compute_s * 1e3:.0f} ms of compute)"
    )
    if efficiency >= SYNC_EFFICIENCY:
        return 0, f"{head}, at least {SYNC_EFFICIENCY:.0%}: synchronous."
    # Local updates trade the optimisation for bandwidth. Where the step would reach the
    # target but for each collective's fixed cost (a small model, a busy machine), fewer and
    # larger buckets are the fix, not another optimisation.
    latency_s = _collectives(m, best) * m.op_overhead_s
    if m.compute_s / max(m.compute_s, sync[best] - latency_s) >= SYNC_EFFICIENCY:
        return 0, (
            f"{head}, but {latency_s * 1e3:.0f} ms of it is the collectives' fixed cost, not "
            "the link's bandwidth: synchronous (a larger fusion_threshold_bytes makes fewer "
            "collectives)."
        )
    # Local updates save bytes. Where the probe's rate carries the step's bytes within the
    # target, the shortfall is something else (a busy core, a preempted rank): stay put.
    wire_s = m.grad_bytes / m.bytes_per_s
    if m.compute_s / (m.compute_s + wire_s) >= SYNC_EFFICIENCY:
        return 0, (
            f"{head}, but the link's measured rate carries the step's "
            f"{m.grad_bytes / 2**10:.0f} KiB in {wire_s * 1e3:.1f} ms: the shortfall is not the "
            "link's bandwidth (a busy machine or the collectives' fixed cost), which local "
            "updates would not fix: synchronous."
        )
    choice = local_policy.choose_local(
        m.grad_numel, m.world_size, m.compute_s, m.in_step_bytes_per_s, m.op_overhead_s, *given
    )
    return choice.sync_every, (
        f"{head}, under {SYNC_EFFICIENCY:.0%}: {choice.why} (This changes the optimisation: "
        "see docs/engine.md.)"
    )


def outer_for(
    m: Measurement, sync_every: int, given: local_policy.Given
) -> local_policy.OuterSettings:
    """The outer exchange for the chosen ``sync_every`` on the measured link (the one
    :func:`choose_sync_every` predicted with)."""
    return local_policy.outer_settings(
        m.grad_numel, sync_every, m.compute_s, m.in_step_bytes_per_s, m.op_overhead_s, *given
    )


def _collectives(m: Measurement, method: str) -> int:
    """Collectives per step with ``method`` (none, fp16 or powersgd)."""
    return m.powersgd_collectives if method == "powersgd" else m.buckets
