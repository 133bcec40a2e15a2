"""Allreduce benchmark: bus bandwidth vs message size for ringtrain and raw torch.distributed.

Both run in the same processes over Gloo, interleaved per size and repeated, so they see the same
machine load; the order alternates between repeats so neither always runs on a warm cache.
``ringtrain`` is ``ringtrain.allreduce_`` (negotiated by name by the background controller, then
executed on ringtrain's data group); ``torch`` is ``torch.distributed.all_reduce`` on the default
group that ``ringtrain.init`` created. Both sum in place, over tensors of zeros (repeated sums of
anything else would overflow to inf after a few hundred rounds).

The fusion case measures the price of many small tensors, which is what a model's gradients are:
``count`` tensors of ``each_bytes`` reduced one call at a time with torch, grouped or as async
submissions with ringtrain (which fuses them), and as one tensor of the same total size. Those
tensors are independent, so fusing them costs two passes over the bytes: packing into the
fusion buffer and copying the results back. ``ringtrain engine`` is the gradient path: as many
parameters, whose gradients live in the engine's buckets (as after the first step of training),
exchanged by ``DistributedOptimizer.synchronize()`` with no copy at all.

With ``reducescatter=True`` (``--reducescatter``) each size also times ``ringtrain.reducescatter``
(Sum) against ``torch.distributed.reduce_scatter_tensor`` on the same bytes, interleaved with
each other. Their bus bandwidth is (n-1)/n * bytes / time (what each rank's link carries in a
ring reduce-scatter), so a link-bound ring shows the link's rate; Gloo's reduce-scatter is an
allreduce of the whole input, and shows half of it.

Each sample starts after a barrier and is the slowest rank's time, since a collective is finished
only when every rank has its result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import ringtrain
from ringtrain import compat
from ringtrain.bench import catalog
from ringtrain.bench.registry import register
from ringtrain.bench.stats import Summary, bus_bandwidth, load_average, machine_info
from ringtrain.bench.timing import WARM_UP_OPS, seconds_per_op
from ringtrain.bench.units import KiB, MiB

DEFAULT_SIZES = catalog.ALLREDUCE_SIZES
# Auto iteration count: enough back-to-back ops per sample to move about this many bytes, so a
# sample of small messages is long enough to time well but a big one is a single op.
SAMPLE_BYTES = 8 * MiB
MAX_ITERS = 50


@dataclass(frozen=True)
class AllreduceParams:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5
    # Ops per timed sample; 0 picks one per size (about SAMPLE_BYTES per sample, at most MAX_ITERS).
    iters: int = 0
    fusion_count: int = 1024
    fusion_each_bytes: int = 64 * KiB
    fusion_repeats: int = 3
    dtype: str = "float32"
    link_mbps: float | None = None
    # Also time ``torch.distributed.all_reduce`` on a ``ringtrain_tcp`` group ("tcp"): the
    # enclave data path (ringtrain's TCP mesh, no Gloo device), beside Gloo ("torch").
    tcp: bool = False
    # Also time reducescatter: ringtrain's against torch's, per size (AllreduceResult.reducescatter).
    reducescatter: bool = False


@dataclass
class SizePoint:
    """One implementation at one message size: seconds per allreduce and bus bandwidth (B/s)."""

    impl: str
    nbytes: int
    iters: int
    time: Summary
    busbw: Summary
    # Bus bandwidth relative to torch's, repeat by repeat (torch's time over this one's): the
    # two run back to back in each repeat, so this pairs them under the same machine load.
    paired: Summary | None = None


@dataclass
class FusionPoint:
    """One way of reducing the fusion case's tensors: seconds for all of them together."""

    case: str
    tensors: int
    nbytes: int
    time: Summary
    busbw: Summary
    # Median time relative to torch's single allreduce of the same total size (1.0 = as fast).
    vs_one_tensor: float = 0.0
    # The same, repeat by repeat: each sample over the torch sample of the same repeat. The cases
    # of one repeat run back to back, so this pairs them under the same machine load.
    paired: Summary | None = None


@dataclass
class AllreduceResult:
    world_size: int
    params: AllreduceParams
    sizes: list[SizePoint] = field(default_factory=list)
    fusion: list[FusionPoint] = field(default_factory=list)
    # Reducescatter, per size, impls "ringtrain" and "torch"; busbw = (n-1)/n * bytes / time.
    reducescatter: list[SizePoint] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)


Op = Callable[[], None]
FUSION_ITERS = 3


def _timed_samples(
    cases: dict[str, tuple[Op, int]],
    repeats: int,
    lane: dict[str, int] | None = None,
    warm_up: int = WARM_UP_OPS,
) -> dict[str, list[float]]:
    """Seconds per op of each case, ``repeats`` samples each, cases interleaved per repeat,
    after ``warm_up`` ops of each. ``lane``: filled with the fast lane's slots over the timed
    ops (taken, lost)."""
    names = list(cases)
    local: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up: buffers allocated, names negotiated, the lane opened
        for _ in range(warm_up):
            cases[name][0]()
    before = _lane_slots() if lane is not None else (0, 0)
    for rep in range(repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for name in order:
            op, iters = cases[name]
            local[name].append(seconds_per_op(op, iters))
    if lane is not None:
        after = _lane_slots()
        lane.update(taken=after[0] - before[0], lost=after[1] - before[1])
    # The slowest rank's time, sample by sample: one small allreduce, outside the timed region.
    flat = torch.tensor([local[n][i] for n in names for i in range(repeats)], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    values = flat.tolist()
    return {n: values[k * repeats : (k + 1) * repeats] for k, n in enumerate(names)}


def _iters_for(nbytes: int, params: AllreduceParams) -> int:
    if params.iters > 0:
        return params.iters
    return max(1, min(MAX_ITERS, SAMPLE_BYTES // max(1, nbytes)))


def _summaries(samples: list[float], nbytes: int, n: int) -> tuple[Summary, Summary]:
    return Summary.of(samples), Summary.of([bus_bandwidth(nbytes, s, n) for s in samples])


def _points(
    samples: dict[str, list[float]], nbytes: int, iters: int, n: int, scale: float = 1.0
) -> list[SizePoint]:
    """One point per impl, paired repeat by repeat with torch's; bus bandwidth times ``scale``
    (0.5 for a reduce-scatter, which moves half an allreduce's bytes)."""
    points = []
    for impl, s in samples.items():
        t = Summary.of(s)
        bw = Summary.of([bus_bandwidth(nbytes, x, n) * scale for x in s])
        ratios = [b / a for a, b in zip(s, samples["torch"]) if a > 0]
        paired = Summary.of(ratios) if ratios else None
        points.append(SizePoint(impl, nbytes, iters, t, bw, paired))
    return points


@register("allreduce")
def bench_allreduce(params: AllreduceParams) -> AllreduceResult:
    """Runs on every rank after ``ringtrain.init()``; every rank returns the same result."""
    n = ringtrain.size()
    dtype = getattr(torch, params.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    result = AllreduceResult(n, params, environment=machine_info())
    tcp_group = _tcp_group() if params.tcp else None
    for nbytes in params.sizes:
        numel = max(1, nbytes // itemsize)
        a = torch.zeros(numel, dtype=dtype)
        b = torch.zeros(numel, dtype=dtype)
        name = f"bench.allreduce.{nbytes}"
        iters = _iters_for(nbytes, params)
        cases: dict[str, tuple[Op, int]] = {
            "ringtrain": (functools.partial(_rt_allreduce, a, name), iters),
            "torch": (functools.partial(dist.all_reduce, b), iters),
        }
        if tcp_group is not None:
            c = torch.zeros(numel, dtype=dtype)
            cases["tcp"] = (functools.partial(dist.all_reduce, c, group=tcp_group), iters)
        # How many of this size's timed ops took the fast lane (collectives/lane.py), and how
        # many lane slots were lost meanwhile.
        lane = {"timed": iters * params.repeats}
        samples = _timed_samples(cases, params.repeats, lane)
        result.environment.setdefault("lane_slots", {})[str(nbytes)] = lane
        result.sizes += _points(samples, numel * itemsize, iters, n)
        if params.reducescatter and n > 1:
            result.reducescatter += _reducescatter_points(nbytes, dtype, iters, params.repeats, n)
    if params.fusion_count > 0 and params.fusion_repeats > 0:
        result.fusion = _fusion(params, dtype, itemsize, n)
    result.environment["load_after"] = load_average()
    return result


def _reducescatter_points(
    nbytes: int, dtype: torch.dtype, iters: int, repeats: int, n: int
) -> list[SizePoint]:
    """ringtrain.reducescatter against torch's reduce_scatter_tensor, interleaved, on an input
    of about ``nbytes`` (a multiple of n elements, as torch's needs)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = max(n, nbytes // itemsize // n * n)
    a = torch.zeros(numel, dtype=dtype)
    b = torch.zeros(numel, dtype=dtype)
    out = torch.empty(numel // n, dtype=dtype)
    name = f"bench.reducescatter.{nbytes}"

    def rt_reducescatter() -> None:
        ringtrain.reducescatter(a, name=name, op=ringtrain.Sum)

    cases: dict[str, tuple[Op, int]] = {
        "ringtrain": (rt_reducescatter, iters),
        "torch": (functools.partial(compat.reduce_scatter_single, out, b), iters),
    }
    return _points(_timed_samples(cases, repeats), numel * itemsize, iters, n, scale=0.5)


def _lane_slots() -> tuple[int, int]:
    from ringtrain.collectives.ops import controller_of

    return controller_of(None).lane_slots


def _tcp_group() -> Any:
    """A world group on ringtrain's TCP mesh (the default group stays what init made)."""
    from ringtrain.transport import tcp_backend

    return dist.new_group(backend=tcp_backend.BACKEND)


def _rt_allreduce(t: torch.Tensor, name: str) -> None:
    ringtrain.allreduce_(t, name=name, op=ringtrain.Sum)


def _fusion(
    params: AllreduceParams, dtype: torch.dtype, itemsize: int, n: int
) -> list[FusionPoint]:
    count = params.fusion_count
    numel = max(1, params.fusion_each_bytes // itemsize)
    small = [torch.zeros(numel, dtype=dtype) for _ in range(count)]
    big = torch.zeros(numel * count, dtype=dtype)
    total = numel * count * itemsize

    def torch_separate() -> None:
        for t in small:
            dist.all_reduce(t)

    def rt_grouped() -> None:
        ringtrain.grouped_allreduce_(small, name="bench.fusion.grouped", op=ringtrain.Sum)

    weights = [torch.nn.Parameter(torch.zeros(numel, dtype=dtype)) for _ in range(count)]
    for w in weights:
        w.grad = torch.zeros_like(w)
    # Sum, as every other case: an average would add one scaling pass over the bucket.
    engine = ringtrain.DistributedOptimizer(torch.optim.SGD(weights, lr=0.0), op=ringtrain.Sum)

    def rt_async() -> None:
        handles = [
            ringtrain.allreduce_async_(t, name=f"bench.fusion.{i}", op=ringtrain.Sum)
            for i, t in enumerate(small)
        ]
        for h in handles:
            ringtrain.synchronize(h)

    # Each sample runs its case FUSION_ITERS times back to back, as a training loop repeats one
    # pattern: the time per op is then the steady state, not the cost of switching cases.
    k = FUSION_ITERS
    cases: dict[str, tuple[Op, int]] = {
        "torch one tensor": (lambda: dist.all_reduce(big), k),
        "torch separate": (torch_separate, k),
        "ringtrain one tensor": (lambda: _rt_allreduce(big, "bench.fusion.big"), k),
        "ringtrain grouped": (rt_grouped, k),
        "ringtrain async": (rt_async, k),
        "ringtrain engine": (engine.synchronize, k),
    }
    # One warm-up op each: the lane changes hands between these cases in every repeat anyway
    # (the burst's names take it from the one tensor), and 256 torch calls take seconds at 16.
    samples = _timed_samples(cases, params.fusion_repeats, warm_up=1)
    points = []
    for case, s in samples.items():
        t, bw = _summaries(s, total, n)
        points.append(FusionPoint(case, 1 if "one tensor" in case else count, total, t, bw))
    base_samples = samples["torch one tensor"]
    base = next(p for p in points if p.case == "torch one tensor").time.median
    for p in points:
        p.vs_one_tensor = p.time.median / base if base > 0 else 0.0
        ratios = [a / b for a, b in zip(samples[p.case], base_samples) if b > 0]
        p.paired = Summary.of(ratios) if ratios else None
    return points
