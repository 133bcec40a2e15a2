"""Bucket plans: which gradients travel together, in which order. Pure functions, no torch.

The engine packs dense gradients into flat fusion buckets and launches each bucket's allreduce
the moment its last gradient is ready. Because no negotiation happens per bucket, every rank must
hold the *same* plan; so the plan is a pure function of data every rank has after one all_gather
(:func:`agree`): each rank's observed ready order, which parameters produced sparse gradients,
which require grad, and their sizes.

Tuning guide:

* ``fusion_threshold_bytes`` caps a bucket. One large Gloo allreduce is far cheaper than many
  small ones (each costs ~1 ms of thread hand-offs), but a bucket can only start once its last
  gradient is ready, so huge buckets delay the start of communication. 0 gives every tensor its
  own allreduce.
* The **link class** sets the bucket size (``reproducible=True``, the default): ``fast`` links
  (loopback, 10 Gbit/s) get buckets of up to ``CLASS_BUCKET_BYTES["fast"]`` (32 MiB), since each
  collective costs about a millisecond of fixed work on the core that also runs backward;
  ``slow`` ones (~1 Gbit/s and below) up to 4 MiB (~30 ms on the wire at 1 Gbit/s), so the link is
  busy from the first layers on. The class is measured once, in the first step's exchange (the
  slowest rank's rate, see :func:`link_class`), and can be pinned (``RINGTRAIN_LINK_CLASS``). The
  plan then depends only on sizes, the ready *order* (which autograd fixes) and settings, so every
  run of a job sums the same values in the same order.
* ``cycle_time_ms`` (only with ``reproducible=False``) closes a bucket at a gap in backward: a
  bucket is closed before a gradient that became ready more than one cycle after the bucket's
  first one did (timed on rank 0's first step), once it takes ``BUCKET_WIRE_S`` on the wire at the
  rate the first exchange measured (see :func:`timed_floor`) and holds at least
  ``MIN_TIMED_BUCKET_BYTES``. Timing then shapes the buckets, and with them the order of the sums:
  a few percent faster at best, never bitwise repeatable.
* ``bucket_order``: "auto" follows the order gradients became ready in the first step on rank 0
  (parameters that rank 0 never saw come after, by the earliest any rank saw them, then in
  reverse registration order). "reverse" is reverse registration order (what DDP assumes),
  "registration" is the optimizer's own order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ringtrain.errors import ConfigError

ORDERS = ("auto", "registration", "reverse")
# Below this a bucket is never closed for timing reasons: a Gloo round costs ~1 ms regardless of
# size, so splitting small buckets costs more than the earlier start gains.
MIN_TIMED_BUCKET_BYTES = 1 << 20
# A bucket closed at a gap must take at least this long on the wire. Each collective costs about
# a millisecond of fixed work (thread hand-offs, Gloo's setup) on the core that also runs
# backward; on a fast link (loopback: ~1 GB/s) many small buckets then cost more CPU than their
# early start gains (measured on the 25M transformer: buckets of 25-64 MiB ran 3-7% faster than
# 4-16 MiB ones), while on a slow link (1 Gbit/s: ~115 MB/s) a few MiB already keep the link busy
# from the first layer on. 30 ms gives loopback buckets of ~30 MiB and 1 Gbit/s ones of ~3.5 MB.
BUCKET_WIRE_S = 0.03
# A bucket smaller than this (or than the threshold, if lower) is not closed because the next
# tensor is big: a bias and its weight travel together rather than the bias alone.
SMALL_BUCKET_BYTES = 256 << 10
NOT_SEEN = -1
# Link classes and their largest bucket (capped by the fusion threshold). The boundary sits far
# from the rates links deliver here (1 Gbit/s: ~115 MB/s; loopback, even on a busy machine:
# 500+ MB/s), so one job measures the same class run after run.
CLASS_BUCKET_BYTES = {"fast": 32 << 20, "slow": 4 << 20}
LINK_CLASSES = ("auto", *CLASS_BUCKET_BYTES)
FAST_LINK_BYTES_PER_S = 250e6
# A measured rate within this factor of the boundary is logged as borderline: pin the class.
BORDERLINE = 1.5


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the planner sees it (``index`` is its position in the optimizer)."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    device: str
    element_size: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class Bucket:
    """Dense gradients packed back to back into one flat buffer, reduced by one collective."""

    index: int
    params: tuple[int, ...]  # parameter indices, in pack order
    offsets: tuple[int, ...]  # element offset of each parameter in the flat buffer
    shapes: tuple[tuple[int, ...], ...]
    numel: int
    dtype: str
    device: str
    nbytes: int

    @property
    def key(self) -> str:
        """Stable name of the bucket, e.g. for a stateful reducer's per-bucket state."""
        return f"bucket{self.index}"


@dataclass(frozen=True)
class Plan:
    """The agreed plan: dense buckets in launch order, then sparse gradients in order."""

    buckets: tuple[Bucket, ...]
    sparse: tuple[int, ...]
    trainable: tuple[bool, ...]  # requires_grad of every optimizer parameter when planned
    order: str
    bucket_of: dict[int, int] = field(default_factory=dict, compare=False)
    digest: str = ""

    def describe(self) -> str:
        parts = [f"{len(b.params)}x/{b.nbytes / 2**20:.2f}MiB" for b in self.buckets]
        return f"{len(self.buckets)} bucket(s) [{', '.join(parts)}], {len(self.sparse)} sparse"


@dataclass(frozen=True)
class Observation:
    """What one rank saw in a learning step, per parameter (index = optimizer position)."""

    position: tuple[int, ...]  # ready order (0 = first), NOT_SEEN if no gradient arrived
    ready_us: tuple[int, ...]  # microseconds after the first ready gradient, 0 if not seen
    sparse: tuple[bool, ...]
    trainable: tuple[bool, ...]
    numel: tuple[int, ...]

    def encode(self) -> list[int]:
        """Flat integers, for an all_gather of one fixed-size tensor."""
        return [
            *self.position,
            *self.ready_us,
            *(int(s) for s in self.sparse),
            *(int(t) for t in self.trainable),
            *self.numel,
        ]

    @classmethod
    def decode(cls, values: Sequence[int], n: int) -> Observation:
        v = [int(x) for x in values]
        return cls(
            tuple(v[0:n]),
            tuple(v[n : 2 * n]),
            tuple(bool(x) for x in v[2 * n : 3 * n]),
            tuple(bool(x) for x in v[3 * n : 4 * n]),
            tuple(v[4 * n : 5 * n]),
        )


def link_class(bytes_per_s: float) -> str:
    """The class of a link that moved gradients at ``bytes_per_s`` (the slowest rank's rate)."""
    return "fast" if bytes_per_s >= FAST_LINK_BYTES_PER_S else "slow"


def borderline(bytes_per_s: float) -> bool:
    """Whether a measured rate lies so near the class boundary that another run may differ."""
    return FAST_LINK_BYTES_PER_S / BORDERLINE <= bytes_per_s < FAST_LINK_BYTES_PER_S * BORDERLINE


def timed_floor(bytes_per_s: float, threshold_bytes: int) -> int:
    """The smallest bucket that a gap in backward may close, for gradients moving at
    ``bytes_per_s`` (0: not measured yet): ``BUCKET_WIRE_S`` of transfer, at least
    ``MIN_TIMED_BUCKET_BYTES``, at most the fusion threshold."""
    floor = int(bytes_per_s * BUCKET_WIRE_S)
    return max(MIN_TIMED_BUCKET_BYTES, min(floor, threshold_bytes))


def agree(
    specs: Sequence[ParamSpec],
    observed: Sequence[Observation],
    *,
    threshold_bytes: int,
    cycle_time_ms: float,
    order: str = "auto",
    min_timed_bytes: int = MIN_TIMED_BUCKET_BYTES,
) -> Plan:
    """The plan every rank computes from every rank's observation (rank 0's first).

    Raises :class:`ConfigError` on every rank alike when ranks disagree on the model.
    """
    if order not in ORDERS:
        raise ConfigError(f"bucket_order must be one of {ORDERS}, got {order!r}")
    _check_same_model(specs, observed)
    n = len(specs)
    trainable = observed[0].trainable
    sparse = [any(o.sparse[i] for o in observed) for i in range(n)]
    dense = [i for i in range(n) if trainable[i] and not sparse[i]]
    first = observed[0]
    ready: dict[int, int] | None = None
    if order == "registration":
        ranked = sorted(dense)
    elif order == "reverse":
        ranked = sorted(dense, reverse=True)
    else:
        big = n + 1

        def key(i: int) -> tuple[int, int, int]:
            mine = first.position[i]
            seen = [o.position[i] for o in observed if o.position[i] != NOT_SEEN]
            return (mine if mine != NOT_SEEN else big, min(seen) if seen else big, -i)

        ranked = sorted(dense, key=key)
        ready = {i: first.ready_us[i] for i in dense if first.position[i] != NOT_SEEN}
    sparse_order = [i for i in range(n) if trainable[i] and sparse[i]]
    return make_plan(
        specs,
        ranked,
        sparse_order,
        trainable,
        threshold_bytes=threshold_bytes,
        cycle_us=cycle_time_ms * 1000.0,
        ready_us=ready,
        order=order,
        min_timed_bytes=min_timed_bytes,
    )


def make_plan(
    specs: Sequence[ParamSpec],
    dense_order: Sequence[int],
    sparse_order: Sequence[int],
    trainable: Sequence[bool],
    *,
    threshold_bytes: int,
    cycle_us: float = 0.0,
    ready_us: dict[int, int] | None = None,
    order: str = "auto",
    min_timed_bytes: int = MIN_TIMED_BUCKET_BYTES,
) -> Plan:
    """Cut ``dense_order`` into buckets: same dtype and device, at most ``threshold_bytes``
    (except that one tensor may exceed it, alone or after a bucket still smaller than
    ``SMALL_BUCKET_BYTES``), split at readiness gaps longer than ``cycle_us`` once a bucket
    holds ``min_timed_bytes``."""
    buckets: list[Bucket] = []
    small = min(threshold_bytes, SMALL_BUCKET_BYTES)
    current: list[int] = []
    size = 0
    start_us: int | None = None

    def close() -> None:
        nonlocal current, size, start_us
        if current:
            buckets.append(_bucket(len(buckets), [specs[i] for i in current]))
        current, size, start_us = [], 0, None

    for i in dense_order:
        s = specs[i]
        if current:
            head = specs[current[0]]
            t = ready_us.get(i) if ready_us else None
            late = (
                t is not None
                and start_us is not None
                and cycle_us > 0
                and t - start_us > cycle_us
                and size >= min_timed_bytes
            )
            if (
                (s.dtype, s.device) != (head.dtype, head.device)
                or (size + s.nbytes > threshold_bytes and size >= small)
                or late
            ):
                close()
        current.append(i)
        size += s.nbytes
        if start_us is None and ready_us:
            start_us = ready_us.get(i)
    close()
    bucket_of = {p: b.index for b in buckets for p in b.params}
    digest = hashlib.sha1(
        repr(([b.params for b in buckets], list(sparse_order), list(trainable))).encode()
    ).hexdigest()[:16]
    return Plan(tuple(buckets), tuple(sparse_order), tuple(trainable), order, bucket_of, digest)


def _bucket(index: int, members: list[ParamSpec]) -> Bucket:
    offsets, pos = [], 0
    for s in members:
        offsets.append(pos)
        pos += s.numel
    head = members[0]
    return Bucket(
        index,
        tuple(s.index for s in members),
        tuple(offsets),
        tuple(s.shape for s in members),
        pos,
        head.dtype,
        head.device,
        pos * head.element_size,
    )


def _check_same_model(specs: Sequence[ParamSpec], observed: Sequence[Observation]) -> None:
    first = observed[0]
    for r, o in enumerate(observed[1:], start=1):
        for i, s in enumerate(specs):
            if o.numel[i] != first.numel[i]:
                raise ConfigError(
                    f"parameter {i} ({s.name!r}) has {first.numel[i]} elements on rank 0 but "
                    f"{o.numel[i]} on rank {r}.\nHINT: every rank must build the same model and "
                    "pass its parameters to the optimizer in the same order."
                )
            if o.trainable[i] != first.trainable[i]:
                raise ConfigError(
                    f"parameter {i} ({s.name!r}) has requires_grad={first.trainable[i]} on rank 0 "
                    f"but {o.trainable[i]} on rank {r}.\nHINT: freeze and unfreeze parameters "
                    "identically on every rank, before the backward pass."
                )
