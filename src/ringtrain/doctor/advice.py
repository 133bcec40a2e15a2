"""Step-time prediction and setting advice for data-parallel training on given hosts.

A model, as simple as it can be while still saying something useful:

- **compute**: one step takes ``step_time_s`` on one rank (measured by the user, at the per-rank
  batch size). Ranks run in lock-step, each on its own batch (weak scaling).
- **communication**: the gradients (``grad_bytes``) are summed with a ring allreduce:
  ``2 (n-1)/n * bytes / bandwidth`` plus ``2 (n-1)`` hop latencies, plus a fixed cost per
  collective (negotiation, launch) for each fusion bucket. The bandwidth is that of the slowest
  link the ring crosses: the slowest host link when ranks span hosts, the host's own (loopback,
  shared memory) otherwise. A measured allreduce bus bandwidth, when there is one, replaces the
  link figure, since it includes what the implementation really achieves.
- **hierarchical** allreduce: a reduce-scatter within each host, a ring across hosts on shards
  (``2 (H-1)/H * bytes`` over the host link, ``2 (H-1)`` cross-host hops), then an allgather
  within each host. It saves cross-host hops, and bytes when a host runs several ranks.
- **overlap**: buckets are reduced while backward still runs, so up to ``overlap`` of the
  communication hides behind the backward pass (``backward_fraction`` of the step); the rest,
  and everything beyond the backward pass, is exposed and adds to the step.
- **compression** scales the bytes: fp16/bf16 send half. PowerSGD at rank 4 sends about
  ``WIRE_RATIO["powersgd"]`` = 1/32 of them (layers ~512 wide: ``(n+m) r / (n m)`` = 1/64,
  doubled for the biases it sends whole and narrower layers) in two collectives per bucket. Top-k at ratio 1% all-gathers (index, value)
  pairs: each rank receives ``(n-1) * 2% * bytes``, which grows with the world size.
- **backward_passes_per_step** k: gradients are accumulated over k backward passes and reduced
  once, so each pass pays ``1/k`` of the exposed communication. It multiplies the effective
  batch by k: the learning rate schedule may need retuning.

- **local updates** (``sync_every`` H, DiLoCo): no gradients travel; every H steps the
  weights are averaged in 16 bits (one fp16 allreduce of the model), so each step pays ``1/H``
  of it and none hides. The per-rank batch stays; the weights agree only every H steps, which
  changes the optimisation (an outer optimizer steps on the averaged change).

The efficiency is ``step_time_s / predicted step``: the share of the ideal n-fold speed-up.
These are estimates (within tens of percent when the inputs are right), meant to rank the
options and to tell "the network will dominate" from "scaling will be fine". Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ringtrain.errors import ConfigError

# Bytes on the wire per byte of fp32 gradient, for the allreduce-based compressors.
WIRE_RATIO = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "powersgd": 1 / 32}
# Collectives per bucket: PowerSGD reduces the uncompressed tensors, then P, then Q.
OPS_PER_BUCKET = {"none": 1, "fp16": 1, "bf16": 1, "powersgd": 3, "topk": 1}
TOPK_RATIO = 0.01
# (int32 index, fp32 value) per kept entry, against 4 bytes per dense entry.
TOPK_PAIR_FACTOR = 2.0
# Preference when several choices meet the target: lossless first, then low-rank, then sparse.
COMPRESSION_ORDER = ("none", "fp16", "powersgd", "topk")
ACCUMULATION_CHOICES = (1, 2, 4, 8)
SYNC_EVERY_CHOICES = (8, 32, 128, 512)
DEFAULT_TARGET = 0.9
# Below this, with the best synchronous setting, data-parallel training is not worth running
# synchronously: the doctor's verdict is not OK.
USEFUL_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Workload:
    """The training job: gradient bytes per step and the measured single-rank step time."""

    grad_bytes: int
    step_time_s: float
    backward_fraction: float = 2 / 3
    overlap: float = 0.8
    # The fusion buffer (Config.fusion_threshold_bytes): one collective per this many bytes.
    bucket_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.grad_bytes <= 0:
            raise ConfigError(
                f"the model size must be > 0 bytes, got {self.grad_bytes}; "
                "HINT: --model-params N or --model-mb MB"
            )
        if self.step_time_s <= 0:
            raise ConfigError(
                f"the step time must be > 0 s, got {self.step_time_s}; "
                "HINT: --step-time S, the measured time of one training step on one rank"
            )
        if not 0 <= self.backward_fraction <= 1 or not 0 <= self.overlap <= 1:
            raise ConfigError("backward_fraction and overlap are fractions in [0, 1]")


@dataclass(frozen=True)
class Fabric:
    """The hosts as the model sees them. Bandwidths in bytes/s, latencies in seconds."""

    ranks_per_host: tuple[int, ...]
    # The slowest link between hosts (ignored for a single host).
    link_bytes_per_s: float
    link_latency_s: float = 100e-6
    # Within a host (loopback or shared memory); None: as fast as the link.
    local_bytes_per_s: float | None = None
    local_latency_s: float = 20e-6
    # Fixed cost of one collective (negotiation, launch): ringtrain's cycle and Gloo's setup.
    op_overhead_s: float = 1e-3
    # A measured allreduce bus bandwidth across these hosts (bytes/s), preferred when given.
    measured_busbw: float | None = None

    def __post_init__(self) -> None:
        if not self.ranks_per_host or min(self.ranks_per_host) < 1:
            raise ConfigError(f"ranks_per_host must list >= 1 rank per host: {self.ranks_per_host}")
        if self.link_bytes_per_s <= 0:
            raise ConfigError(f"link bandwidth must be > 0 bytes/s, got {self.link_bytes_per_s}")

    @property
    def world(self) -> int:
        return sum(self.ranks_per_host)

    @property
    def hosts(self) -> int:
        return len(self.ranks_per_host)

    @property
    def ring_bandwidth(self) -> float:
        """What limits a flat ring over every rank."""
        if self.measured_busbw:
            return self.measured_busbw
        if self.hosts > 1:
            return self.link_bytes_per_s
        return self.local_bytes_per_s or self.link_bytes_per_s


@dataclass(frozen=True)
class Choice:
    compression: str = "none"
    backward_passes_per_step: int = 1
    hierarchical: bool = False

    def label(self) -> str:
        parts = [f"compression={self.compression}"]
        parts.append(f"backward_passes_per_step={self.backward_passes_per_step}")
        parts.append(f"hierarchical={'on' if self.hierarchical else 'off'}")
        return " ".join(parts)


@dataclass(frozen=True)
class Prediction:
    choice: Choice
    comm_s: float  # one reduction of all gradients
    exposed_s: float  # per step (one backward pass), after overlap and accumulation
    step_s: float  # predicted time of one backward pass's step on n ranks
    efficiency: float  # step_time_s / step_s
    speedup: float  # efficiency * world size

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["choice"] = asdict(self.choice)
        return d


@dataclass(frozen=True)
class LocalPrediction:
    """Local updates every ``sync_every`` steps (the outer exchange: 16-bit weights)."""

    sync_every: int
    comm_s: float  # one outer exchange
    step_s: float  # per step, with 1/sync_every of the exchange
    efficiency: float
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Advice:
    recommended: Prediction
    baseline: Prediction
    by_compression: tuple[Prediction, ...]
    reasons: list[str] = field(default_factory=list)
    target: float = DEFAULT_TARGET
    local_updates: tuple[LocalPrediction, ...] = ()

    @property
    def best_synchronous(self) -> float:
        """The best efficiency of a synchronous setting that keeps the batch (no accumulation)."""
        return max(p.efficiency for p in self.by_compression)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recommended": self.recommended.to_dict(),
            "baseline": self.baseline.to_dict(),
            "by_compression": [p.to_dict() for p in self.by_compression],
            "local_updates": [p.to_dict() for p in self.local_updates],
            "best_synchronous_efficiency": self.best_synchronous,
            "reasons": list(self.reasons),
            "target_efficiency": self.target,
        }


def _dur(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def ring_allreduce_s(nbytes: float, n: int, bandwidth: float, hop_latency_s: float) -> float:
    """Seconds for a ring allreduce of ``nbytes`` over ``n`` ranks (0 for one rank)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * hop_latency_s


def ring_allgather_s(nbytes_each: float, n: int, bandwidth: float, hop_latency_s: float) -> float:
    """Seconds for a ring allgather where every rank contributes ``nbytes_each``."""
    if n <= 1 or nbytes_each <= 0:
        return 0.0
    return (n - 1) * nbytes_each / bandwidth + (n - 1) * hop_latency_s


def comm_seconds(workload: Workload, fabric: Fabric, choice: Choice) -> float:
    """Seconds to reduce one step's gradients on ``fabric`` with ``choice``."""
    n = fabric.world
    if n <= 1:
        return 0.0
    comp = choice.compression
    if comp not in OPS_PER_BUCKET:
        raise ConfigError(
            f"unknown compression {comp!r}; expected one of {', '.join(COMPRESSION_ORDER)}"
        )
    buckets = max(1, math.ceil(workload.grad_bytes / workload.bucket_bytes))
    overhead = buckets * OPS_PER_BUCKET[comp] * fabric.op_overhead_s
    multi_host = fabric.hosts > 1
    hop = fabric.link_latency_s if multi_host else fabric.local_latency_s
    if comp == "topk":
        each = workload.grad_bytes * TOPK_RATIO * TOPK_PAIR_FACTOR
        return ring_allgather_s(each, n, fabric.ring_bandwidth, hop) + overhead
    nbytes = workload.grad_bytes * WIRE_RATIO[comp]
    if choice.hierarchical and multi_host:
        local = fabric.local_bytes_per_s or fabric.link_bytes_per_s
        s = max(fabric.ranks_per_host)
        cross_bw = fabric.measured_busbw or fabric.link_bytes_per_s
        within = 2 * (s - 1) / s * nbytes / local + 2 * (s - 1) * fabric.local_latency_s
        across = ring_allreduce_s(nbytes, fabric.hosts, cross_bw, fabric.link_latency_s)
        return within + across + overhead
    return ring_allreduce_s(nbytes, n, fabric.ring_bandwidth, hop) + overhead


def predict(workload: Workload, fabric: Fabric, choice: Choice | None = None) -> Prediction:
    """The step time and scaling efficiency of ``workload`` on ``fabric`` with ``choice``."""
    choice = choice or Choice()
    if choice.backward_passes_per_step < 1:
        raise ConfigError(
            f"backward_passes_per_step must be >= 1, got {choice.backward_passes_per_step}"
        )
    comm = comm_seconds(workload, fabric, choice)
    # Communication overlaps the last backward pass only; accumulation divides what is left.
    hidden = min(workload.overlap * comm, workload.backward_fraction * workload.step_time_s)
    exposed = (comm - hidden) / choice.backward_passes_per_step
    step = workload.step_time_s + exposed
    eff = workload.step_time_s / step
    return Prediction(choice, comm, exposed, step, eff, eff * fabric.world)


def predict_local(workload: Workload, fabric: Fabric, sync_every: int) -> LocalPrediction:
    """Local updates every ``sync_every`` steps: one fp16 allreduce of the weights (as many
    bytes as the gradients' fp16 exchange) per ``sync_every`` steps, none of it hidden."""
    if sync_every < 1:
        raise ConfigError(f"sync_every must be >= 1, got {sync_every}")
    comm = comm_seconds(workload, fabric, Choice("fp16"))
    step = workload.step_time_s + comm / sync_every
    eff = workload.step_time_s / step
    return LocalPrediction(sync_every, comm, step, eff, eff * fabric.world)


def _hierarchical_helps(workload: Workload, fabric: Fabric) -> bool:
    if fabric.hosts < 2 or max(fabric.ranks_per_host) < 2:
        return False
    flat = predict(workload, fabric, Choice(hierarchical=False))
    hier = predict(workload, fabric, Choice(hierarchical=True))
    return hier.step_s <= flat.step_s


def recommend(workload: Workload, fabric: Fabric, target: float = DEFAULT_TARGET) -> Advice:
    """The least intrusive settings predicted to reach ``target`` efficiency, with reasons.

    Order of preference: no change; hierarchical allreduce (free where several hosts run
    several ranks); compression in :data:`COMPRESSION_ORDER` (fp16 is nearly free, PowerSGD
    and top-k change the numerics); then accumulation (k in 2, 4, 8), which changes the
    effective batch. When nothing reaches the target, the best predicted setting is given.
    """
    if not 0 < target <= 1:
        raise ConfigError(f"target efficiency must be in (0, 1], got {target}")
    hier = _hierarchical_helps(workload, fabric)
    baseline = predict(workload, fabric, Choice())
    by_comp = tuple(
        predict(workload, fabric, Choice(c, 1, hier and c != "topk")) for c in COMPRESSION_ORDER
    )
    reasons: list[str] = []
    n = fabric.world
    if n <= 1:
        reasons.append("one rank: nothing to communicate.")
        return Advice(baseline, baseline, by_comp, reasons, target)
    local = tuple(predict_local(workload, fabric, h) for h in SYNC_EVERY_CHOICES)
    reasons.append(
        f"reducing {workload.grad_bytes / 2**20:.1f} MiB of gradients over {n} ranks takes "
        f"~{_dur(baseline.comm_s)} against {_dur(workload.step_time_s)} of compute; "
        f"predicted efficiency {baseline.efficiency:.0%} with no change."
    )
    if hier:
        reasons.append(
            "hierarchical allreduce: several ranks per host share each host link, so reducing "
            "within hosts first saves cross-host hops (ringtrain's 'auto' picks it here)."
        )
    candidates = [
        Choice(c, k, hier and c != "topk") for k in ACCUMULATION_CHOICES for c in COMPRESSION_ORDER
    ]
    chosen = None
    for c in candidates:
        p = predict(workload, fabric, c)
        if p.efficiency >= target:
            chosen = p
            break
    if chosen is None:
        chosen = max((predict(workload, fabric, c) for c in candidates), key=lambda p: p.efficiency)
        reasons.append(
            f"no setting reaches {target:.0%}: the best predicted is {chosen.choice.label()} "
            f"at {chosen.efficiency:.0%}. The network is too slow for this model and step time; "
            "larger per-rank batches (longer steps) or fewer hosts scale better."
        )
    c = chosen.choice
    if c.compression != "none":
        what = {
            "fp16": "fp16 halves the bytes on the wire at almost no accuracy cost",
            "bf16": "bf16 halves the bytes on the wire",
            "powersgd": "PowerSGD (rank 4, with error feedback) sends ~1/32 of the bytes; "
            "tune matrix_approximation_rank and start_iter",
            "topk": f"top-k ({TOPK_RATIO:.0%}, with error feedback) sends only the largest "
            "entries; it pays while ratio x world size is well below 1",
        }[c.compression]
        reasons.append(f"compression={c.compression}: {what}.")
    if c.backward_passes_per_step > 1:
        reasons.append(
            f"backward_passes_per_step={c.backward_passes_per_step}: reduce once every "
            f"{c.backward_passes_per_step} backward passes; the effective batch grows "
            f"{c.backward_passes_per_step}x (n x k x B = {n * c.backward_passes_per_step} B "
            "for a per-rank batch B), so revisit the learning rate."
        )
    if chosen.efficiency < target or c.backward_passes_per_step > 1:
        pick = next((p for p in local if p.efficiency >= target), local[-1])
        reasons.append(
            f"local updates: sync_every={pick.sync_every} is predicted at {pick.efficiency:.0%} "
            f"({pick.speedup:.1f}x on {n} ranks; "
            + ", ".join(f"sync_every={p.sync_every} {p.efficiency:.0%}" for p in local)
            + "). The batch stays n x B = "
            f"{n} B per step; the weights are averaged every {pick.sync_every} steps "
            f"({n * pick.sync_every} B samples apart) and an outer optimizer steps on their "
            "change, which changes the optimisation (docs/engine.md, 'Local updates')."
        )
    if chosen.choice == replace(Choice(), hierarchical=hier) and chosen.efficiency >= target:
        reasons.append(f"predicted efficiency {chosen.efficiency:.0%}: no change needed.")
    else:
        reasons.append(
            f"predicted with {c.label()}: step {_dur(chosen.step_s)}, efficiency "
            f"{chosen.efficiency:.0%}, speed-up {chosen.speedup:.1f}x on {n} ranks."
        )
    return Advice(chosen, baseline, by_comp, reasons, target, local)
