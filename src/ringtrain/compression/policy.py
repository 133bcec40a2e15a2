"""``compression="auto"``: choose the gradient compression from what a few steps measured.

The decision is a pure function of a :class:`Measurement` (taken by the engine, see
:mod:`ringtrain.engine.auto`), so it is testable with synthetic numbers and, given the same
numbers, the same on every rank. The model, as plain as it can be:

* A step of uncompressed training takes ``compute_s + wait_s``: the work of the step, plus the
  time ``step()`` waited for the exchange (what overlap did not hide). ``comm_s`` is how long
  bucket allreduces were in flight; ``comm_s - wait_s`` of it hid behind backward.
* The link is described by ``bytes_per_s``, the throughput of a probe allreduce of up to a few
  MiB, and by the cost of one collective inside a step, ``op_overhead_s``: what of ``comm_s`` the
  bytes do not explain, per bucket (at least a tiny allreduce's ``latency_s``, at most
  :data:`OP_OVERHEAD_MAX_LATENCIES` of them). Small models are all overhead, and no compression
  removes collectives. Time beyond that cap is the link moving the step's bytes slower than it
  moved the probe's (a shaped link under sustained traffic), so it is charged per byte:
  ``in_step_bytes_per_s``.
* A method's communication time is ``collectives x op_overhead + wire bytes / throughput + its
  own compute`` (casting, factorizing, selecting, at ``*_S_PER_ELEMENT``: rough figures for one CPU
  core, much lower on a GPU). fp16 sends half the bytes; PowerSGD the numbers its layouts say
  (``powersgd_wire_numel``) in two collectives per bucket; top-k all-gathers
  ``ratio x numel`` (index, value) pairs, which grows with the world size. The same amount
  hides behind backward as did uncompressed, except the method's own compute on a rank with no
  core to spare (``spare_core`` false): the reducer thread then takes its time from backward.

Rules, in order: one rank, or an exchange adding under :data:`MIN_WAIT_SHARE` of the step, keeps
``none`` ("never make a fast link slower"); a method must be predicted to shorten the step by at
least :data:`MIN_GAIN`; among methods predicted within :data:`NEAR_BEST` of the best, the first
of :data:`PREFERENCE` wins (lossless-ish first, then low-rank, then sparse). Then the engine
*tries* the choice for a few steps and keeps it only if the measured step is at least
:data:`KEEP_MARGIN` shorter (:func:`keep`), so a wrong prediction costs a few steps, not a job.

Accumulation (``backward_passes_per_step``) is recommended, never applied: it changes the
effective batch and needs the training loop to run k backward passes per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ringtrain.compression.base import register, resolve
from ringtrain.errors import ConfigError

PREFERENCE = ("none", "fp16", "powersgd", "topk")
# Below this share of the step spent waiting for the exchange, compression cannot pay.
MIN_WAIT_SHARE = 0.05
# A method must be predicted to shorten the step by this share to be tried.
MIN_GAIN = 0.10
# Methods predicted within this share of the best one count as equally good.
NEAR_BEST = 0.05
# A tried method is kept only if its measured step is this much shorter than uncompressed.
KEEP_MARGIN = 0.03
# Seconds of local work per gradient element, one CPU core (measured on transformer-25m's
# buckets: fp16 cast there and back ~6 ns, PowerSGD rank 2 ~4 ns, top-k 1% with the sampled
# threshold ~6 ns; PowerSGD and top-k doubled and more for safety, as they were noisy under
# load). On CUDA the engine divides them by CUDA_SPEEDUP.
FP16_S_PER_ELEMENT = 6e-9
POWERSGD_S_PER_ELEMENT = 10e-9
TOPK_S_PER_ELEMENT = 15e-9
CUDA_SPEEDUP = 50.0
# One collective's own cost inside a step is at most this many tiny-allreduce latencies (thread
# hand-offs and contention with backward make it several). On a 100 Mbit/s link, charging all the
# time the probe's throughput does not explain per collective came to 38 ms each and priced
# PowerSGD, with two collectives per bucket, above top-k, which measured slower.
OP_OVERHEAD_MAX_LATENCIES = 10
# Exposed communication above this share of compute makes accumulation worth recommending.
ACCUMULATE_ABOVE = 0.25
ACCUMULATION_CHOICES = (2, 4, 8)


@dataclass(frozen=True)
class Measurement:
    """What the engine measured over a few uncompressed steps (slowest rank's figures)."""

    world_size: int
    grad_bytes: int  # dense gradient bytes reduced per step
    grad_numel: int
    element_size: int  # bytes per gradient element (4 for float32)
    buckets: int
    compute_s: float  # per step, everything but waiting for the exchange
    wait_s: float  # per step, time step() waited for the uncompressed exchange
    comm_s: float  # per step, time some bucket allreduce was in flight
    latency_s: float  # one tiny allreduce
    bytes_per_s: float  # allreduce throughput (tensor bytes per second) of a probe
    powersgd_wire_numel: int  # numbers each rank sends per step with PowerSGD
    powersgd_collectives: int  # collectives per step with PowerSGD
    topk_ratio: float
    on_cuda: bool = False
    # Every rank has a CPU core beyond its torch threads, so a reducer's work can run beside
    # backward; without one it adds to the step (a rank bound to one core).
    spare_core: bool = True

    def __post_init__(self) -> None:
        bad = {
            k: v
            for k, v in (
                ("compute_s", self.compute_s),
                ("wait_s", self.wait_s),
                ("comm_s", self.comm_s),
                ("latency_s", self.latency_s),
            )
            if not (v >= 0 and math.isfinite(v))
        }
        if not self.bytes_per_s > 0:
            bad["bytes_per_s"] = self.bytes_per_s
        if bad or self.world_size < 1 or self.grad_bytes < 0 or self.buckets < 0:
            raise ConfigError(
                f"a compression policy measurement must hold finite times >= 0, a world size "
                f">= 1 and sizes >= 0; got {self}.\nHINT: this is a bug in the measurement."
            )

    @property
    def step_s(self) -> float:
        return self.compute_s + self.wait_s

    @property
    def op_overhead_s(self) -> float:
        """Cost of one collective inside a step, beyond its bytes."""
        if self.buckets == 0:
            return self.latency_s
        unexplained = self.comm_s - self.grad_bytes / self.bytes_per_s
        per_op = max(self.latency_s, unexplained / self.buckets)
        return min(per_op, OP_OVERHEAD_MAX_LATENCIES * self.latency_s)

    @property
    def in_step_bytes_per_s(self) -> float:
        """Throughput the step's own exchange got: the probe's, or less if the step's bytes
        took longer than the probe's rate and the collectives' overhead explain."""
        wire_s = self.comm_s - self.buckets * self.op_overhead_s
        if self.grad_bytes <= 0 or wire_s <= 0:
            return self.bytes_per_s
        return min(self.bytes_per_s, self.grad_bytes / wire_s)


@dataclass(frozen=True)
class Decision:
    """The chosen method, the recommended accumulation, and why."""

    compression: str
    backward_passes_per_step: int
    reason: str
    predicted_step_s: dict[str, float] = field(default_factory=dict)


def predict_comm_s(m: Measurement, method: str) -> float:
    """Seconds of communication (with the method's own compute) per step for ``method``."""
    if method == "none":
        return m.comm_s
    transfer, local = _costs(m, method)
    return transfer + local


def _costs(m: Measurement, method: str) -> tuple[float, float]:
    """(collectives and bytes, the method's own compute) in seconds per step."""
    bw = m.in_step_bytes_per_s
    op = m.op_overhead_s
    speed = CUDA_SPEEDUP if m.on_cuda else 1.0
    if method == "fp16":
        wire = m.grad_bytes * min(1.0, 2 / max(m.element_size, 1))
        return m.buckets * op + wire / bw, FP16_S_PER_ELEMENT * m.grad_numel / speed
    if method == "powersgd":
        wire = m.powersgd_wire_numel * m.element_size
        local = POWERSGD_S_PER_ELEMENT * m.grad_numel / speed
        return m.powersgd_collectives * op + wire / bw, local
    if method == "topk":
        # Each rank sends k (int32 index, value) pairs; an allgather moves n/2 times what an
        # allreduce of the same per-rank bytes moves (ring: (n-1) k vs 2 (n-1)/n k per rank).
        pairs = math.ceil(m.topk_ratio * m.grad_numel) * (4 + m.element_size)
        local = TOPK_S_PER_ELEMENT * m.grad_numel / speed
        return m.buckets * op + m.world_size * pairs / (2 * bw), local
    raise ConfigError(f"unknown method {method!r}; expected one of {', '.join(PREFERENCE)}")


def predict_step_s(m: Measurement, method: str) -> float:
    """Predicted step seconds: compute plus what overlap does not hide."""
    if method == "none":
        return m.step_s
    hidden = max(0.0, m.comm_s - m.wait_s)
    transfer, local = _costs(m, method)
    if m.on_cuda or m.spare_core:
        return m.compute_s + max(0.0, transfer + local - hidden)
    return m.compute_s + local + max(0.0, transfer - hidden)


def _accumulation(m: Measurement, exposed_s: float) -> tuple[int, str]:
    if m.compute_s <= 0 or exposed_s <= ACCUMULATE_ABOVE * m.compute_s:
        return 1, ""
    target = 0.1 * m.compute_s
    k = next((k for k in ACCUMULATION_CHOICES if exposed_s / k <= target), ACCUMULATION_CHOICES[-1])
    return k, (
        f" Communication still adds {exposed_s * 1e3:.0f} ms to {m.compute_s * 1e3:.0f} ms of "
        f"compute: backward_passes_per_step={k} would cut that {k}x (not applied: it changes "
        "the effective batch; set it yourself)."
    )


def choose(m: Measurement, methods: tuple[str, ...] = PREFERENCE) -> Decision:
    """The compression to try, from a measurement (pure; the same everywhere for equal input)."""
    step = m.step_s
    if m.world_size <= 1:
        return Decision("none", 1, "one rank: nothing is exchanged.", {"none": step})
    base = (
        f"uncompressed, a step is {step * 1e3:.1f} ms: {m.compute_s * 1e3:.1f} ms of compute "
        f"and {m.wait_s * 1e3:.1f} ms waiting for {m.grad_bytes / 2**20:.1f} MiB of gradients "
        f"(allreduce ~{m.in_step_bytes_per_s / 2**20:.0f} MiB/s in the step, "
        f"{m.op_overhead_s * 1e3:.2f} ms per collective"
        + ("" if m.on_cuda or m.spare_core else "; no spare core for a reducer")
        + ")"
    )
    if m.wait_s <= MIN_WAIT_SHARE * step:
        return Decision(
            "none",
            1,
            f"{base}; under {MIN_WAIT_SHARE:.0%} of the step is communication, so no "
            "compression can pay for itself.",
            {"none": step},
        )
    candidates = [c for c in methods if c in PREFERENCE]
    if m.element_size <= 2:
        candidates = [c for c in candidates if c != "fp16"]  # already 16-bit
    if m.powersgd_wire_numel >= m.grad_numel:
        candidates = [c for c in candidates if c != "powersgd"]  # nothing to factorize
    predicted = {c: predict_step_s(m, c) for c in candidates}
    predicted["none"] = step
    best = min(predicted.values())
    if best > step * (1 - MIN_GAIN):
        k, more = _accumulation(m, m.wait_s)
        return Decision(
            "none",
            k,
            f"{base}; no compression is predicted to save {MIN_GAIN:.0%} of it "
            f"(best {best * 1e3:.1f} ms).{more}",
            predicted,
        )
    chosen = next(
        c for c in PREFERENCE if c in predicted and predicted[c] <= best * (1 + NEAR_BEST)
    )
    k, more = _accumulation(m, predicted[chosen] - m.compute_s)
    others = ", ".join(f"{c} {t * 1e3:.1f} ms" for c, t in predicted.items() if c != chosen)
    return Decision(
        chosen,
        k,
        f"{base}; {chosen} is predicted to take {predicted[chosen] * 1e3:.1f} ms ({others}).{more}",
        predicted,
    )


def keep(
    uncompressed_step_s: float, tried_step_s: float, uncompressed_wait_s: float = math.inf
) -> bool:
    """Whether a tried method measured enough faster than uncompressed to keep it. Compression
    can save at most the time a step waited for the exchange (``uncompressed_wait_s``): a gain
    beyond it is noise in the uncompressed steps' compute (warm-up, a busy core), not the
    method's, and does not count."""
    saving = min(uncompressed_step_s - tried_step_s, uncompressed_wait_s)
    return saving >= uncompressed_step_s * KEEP_MARGIN


class AutoCompression:
    """What ``compression="auto"`` resolves to: a placeholder the engine fills in.

    The engine (:mod:`ringtrain.engine.auto`) measures, decides, tries and then calls
    :meth:`settle`; until then gradients travel uncompressed. Outside DistributedOptimizer (e.g.
    ``ringtrain.allreduce(..., compression="auto")``) it sends tensors as they are.
    ``state_dict`` keeps a settled choice, the chosen compressor's state and, with
    ``sync_every="auto"``, the local-update choice made from the same measurement, so a resumed
    job skips the measurement and trains as before.
    """

    name = "auto"

    def __init__(self, config: Any = None) -> None:
        self.config = config
        self.choice: str | None = None  # the method in use (tentative while tried)
        self.settled = False
        self.decision: Decision | None = None
        self.inner: Any = resolve("none")
        self.sync_every: int | None = None  # sync_every="auto"'s choice (0: synchronous), once made

    @classmethod
    def from_config(cls, config: Any) -> AutoCompression:
        return cls(config)

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor

    def use(self, choice: str, **overrides: Any) -> Any:
        """Switch to ``choice`` (built from the config, with ``overrides`` applied to it)."""
        config = self.config
        if config is not None and overrides:
            config = config.replace(**overrides)
        self.choice = choice
        self.inner = resolve(choice, config)
        return self.inner

    def settle(self, decision: Decision) -> None:
        self.decision = decision
        self.settled = True

    def state_dict(self) -> dict[str, Any]:
        if not self.settled:  # a resumed job measures again, keeping sync_every=auto's choice
            every = {} if self.sync_every is None else {"sync_every": self.sync_every}
            return {"name": self.name, "version": 1, **every} if every else {}
        get = getattr(self.inner, "state_dict", None)
        return {
            "name": self.name,
            "version": 1,
            "choice": self.choice,
            "reason": self.decision.reason if self.decision else "",
            "inner": get() if callable(get) else {},
            **({} if self.sync_every is None else {"sync_every": self.sync_every}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") == 1 and "choice" not in state and "sync_every" in state:
            self.sync_every = state["sync_every"]  # saved before the compression was chosen
            return
        if state.get("version") != 1 or "choice" not in state:
            raise ConfigError(
                f"this is not an auto-compression v1 state (keys {sorted(state)}).\n"
                "HINT: resume with the compression the checkpoint was written with."
            )
        self.use(state["choice"])
        load = getattr(self.inner, "load_state_dict", None)
        if callable(load) and state.get("inner"):
            load(state["inner"])
        self.settle(
            Decision(state["choice"], 1, f"restored from a checkpoint: {state.get('reason', '')}")
        )
        self.sync_every = state.get("sync_every")


register("auto", AutoCompression)
