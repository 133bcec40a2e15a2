"""CPU time per allreduce: ringtrain against raw torch.distributed, all threads, idle tail included.

Wall time on a shared machine measures the neighbours as much as the code; CPU time does not
grow with load the same way: it is what this process burnt, whoever else runs. So each sample
is this process's CPU time (every thread: the caller's, the controllers', Gloo's, OpenMP's
workers) over ``iters`` back-to-back ops *and* an idle tail after them (``tail_s``), divided
by ``iters``. The tail catches what an op leaves running after it returns: OpenMP workers
spinning after a parallel copy, controllers negotiating idle rounds before they doze.

``ringtrain`` is ``ringtrain.allreduce_`` (Sum, in place; a repeated op rides the fast lane);
``torch`` is ``torch.distributed.all_reduce`` on the default group, in the same processes,
interleaved per size and repeat with the order alternating, each sample started from dozing
controllers and a barrier. The burst case (``burst_count`` > 0) is Horovod's usual pattern,
``burst_count`` async allreduces of ``burst_each_bytes`` then ``synchronize``, against torch's
one allreduce of the same bytes: CPU time per burst, and the Gloo ops it took (ringtrain's
executor counts them).

Every rank returns the same result: per sample, the mean over ranks of CPU time per op (and the
largest rank's), and ringtrain's over torch's repeat by repeat (``paired``). Run it at 1 and 2
torch threads (``--threads``): a parallel copy costs nothing extra at 1.

    ringtrain bench cpu -np 3 --threads 2 --sizes 64K..16M
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import ringtrain
from ringtrain.bench import catalog
from ringtrain.bench.registry import register
from ringtrain.bench.stats import Summary, load_average, machine_info
from ringtrain.bench.timing import WARM_UP_OPS, settle
from ringtrain.bench.units import KiB, MiB, fmt_bytes

DEFAULT_SIZES = catalog.CPU_SIZES
# Ops per sample: about this many bytes, at least MIN_ITERS ops (CPU clocks tick finely, but
# the tail's share per op should stay small).
SAMPLE_BYTES = 64 * MiB
MIN_ITERS = 8
MAX_ITERS = 200


@dataclass(frozen=True)
class CpuParams:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5
    iters: int = 0  # ops per sample; 0: about SAMPLE_BYTES, MIN_ITERS-MAX_ITERS
    tail_s: float = 0.1
    burst_count: int = 256
    burst_each_bytes: int = 64 * KiB


@dataclass
class CpuPoint:
    """One case at one size: CPU seconds per op per rank (mean over ranks, and the top rank),
    wall seconds per op, and CPU time over torch's, repeat by repeat."""

    impl: str
    nbytes: int
    iters: int
    cpu: Summary
    cpu_top_rank: Summary
    wall: Summary
    paired: Summary | None = None
    gloo_ops: float | None = None  # per op (per burst), ringtrain's fused Gloo ops


@dataclass
class CpuResult:
    world_size: int
    threads: int
    params: CpuParams
    sizes: list[CpuPoint] = field(default_factory=list)
    burst: list[CpuPoint] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)


Op = Callable[[], object]


def _sample(op: Op, iters: int, tail_s: float) -> tuple[float, float]:
    """CPU seconds per op of this whole process (tail included), and wall seconds per op."""
    settle()
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        op()
    wall = time.perf_counter() - t0
    time.sleep(tail_s)
    return (time.process_time() - c0) / iters, wall / iters


def _measure(
    cases: dict[str, tuple[Op, int]], repeats: int, tail_s: float
) -> dict[str, list[tuple[float, float, float]]]:
    """Per case and repeat: (mean CPU/op over ranks, top rank's CPU/op, slowest wall/op)."""
    names = list(cases)
    for name in names:  # warm-up: buffers, names negotiated, the lane opened
        op, _ = cases[name]
        for _ in range(WARM_UP_OPS):
            op()
    local: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            op, iters = cases[name]
            local[name].append(_sample(op, iters, tail_s))
    cpu = torch.tensor([local[n][i][0] for n in names for i in range(repeats)], dtype=torch.float64)
    wall = torch.tensor(
        [local[n][i][1] for n in names for i in range(repeats)], dtype=torch.float64
    )
    top = cpu.clone()
    dist.all_reduce(cpu)  # outside every sample
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    n = dist.get_world_size()
    out: dict[str, list[tuple[float, float, float]]] = {}
    for k, name in enumerate(names):
        rows = range(k * repeats, (k + 1) * repeats)
        out[name] = [(float(cpu[i]) / n, float(top[i]), float(wall[i])) for i in rows]
    return out


def _points(
    samples: dict[str, list[tuple[float, float, float]]], base: str, nbytes: int, iters: int
) -> list[CpuPoint]:
    points = []
    for impl, s in samples.items():
        ratios = [a[0] / b[0] for a, b in zip(s, samples[base]) if b[0] > 0]
        points.append(
            CpuPoint(
                impl,
                nbytes,
                iters,
                Summary.of([x[0] for x in s]),
                Summary.of([x[1] for x in s]),
                Summary.of([x[2] for x in s]),
                Summary.of(ratios) if ratios else None,
            )
        )
    return points


def _iters_for(nbytes: int, params: CpuParams) -> int:
    if params.iters > 0:
        return params.iters
    return max(MIN_ITERS, min(MAX_ITERS, SAMPLE_BYTES // max(1, nbytes)))


def _gloo_ops() -> int:
    """Fused allreduces ringtrain's executor of the world set has run so far."""
    from ringtrain.collectives.ops import controller_of

    return int(controller_of(None)._executor.fused_ops)


@register("cpu")
def bench_cpu(params: CpuParams) -> CpuResult:
    """Runs on every rank after ``ringtrain.init()``; every rank returns the same result."""
    res = CpuResult(ringtrain.size(), torch.get_num_threads(), params, environment=machine_info())
    for nbytes in params.sizes:
        numel = max(1, nbytes // 4)
        a, b = torch.zeros(numel), torch.zeros(numel)  # zeros: repeated sums stay finite
        name = f"bench.cpu.{nbytes}"
        op_rt = functools.partial(ringtrain.allreduce_, a, name=name, op=ringtrain.Sum)
        op_torch = functools.partial(dist.all_reduce, b)
        iters = _iters_for(nbytes, params)
        cases: dict[str, tuple[Op, int]] = {"ringtrain": (op_rt, iters), "torch": (op_torch, iters)}
        res.sizes += _points(_measure(cases, params.repeats, params.tail_s), "torch", nbytes, iters)
    if params.burst_count > 0:
        res.burst = _burst(params)
    res.environment["load_after"] = load_average()
    return res


def _burst(params: CpuParams) -> list[CpuPoint]:
    count, numel = params.burst_count, max(1, params.burst_each_bytes // 4)
    small = [torch.zeros(numel) for _ in range(count)]
    big = torch.zeros(numel * count)

    def rt_async() -> None:
        handles = [
            ringtrain.allreduce_async_(t, name=f"bench.cpu.burst.{i}", op=ringtrain.Sum)
            for i, t in enumerate(small)
        ]
        for h in handles:
            ringtrain.synchronize(h)

    def torch_one() -> None:
        dist.all_reduce(big)

    iters = 3
    before = _gloo_ops()
    cases: dict[str, tuple[Op, int]] = {
        "ringtrain async": (rt_async, iters),
        "torch one tensor": (torch_one, iters),
    }
    points = _points(
        _measure(cases, params.repeats, params.tail_s), "torch one tensor", count * numel * 4, iters
    )
    runs = iters * params.repeats + WARM_UP_OPS
    points[0].gloo_ops = (_gloo_ops() - before) / runs
    return points


def format_cpu(res: CpuResult, markdown: bool = False) -> str:
    from ringtrain.bench.report import _load, table

    def ms(s: Summary) -> str:
        return f"{s.median * 1e3:.3g} [{s.min * 1e3:.3g}-{s.max * 1e3:.3g}]"

    def ratio(p: CpuPoint) -> str:
        r = p.paired
        return f"{r.median:.2f}x [{r.min:.2f}-{r.max:.2f}]" if r is not None else "-"

    by = {(p.impl, p.nbytes): p for p in res.sizes}
    rows = []
    for nbytes in sorted({p.nbytes for p in res.sizes}):
        rt, th = by[("ringtrain", nbytes)], by[("torch", nbytes)]
        rows.append(
            [
                fmt_bytes(nbytes),
                ms(rt.cpu),
                ms(th.cpu),
                ratio(rt),
                f"{rt.cpu_top_rank.median * 1e3:.3g} / {th.cpu_top_rank.median * 1e3:.3g}",
                f"{rt.wall.median * 1e3:.3g} / {th.wall.median * 1e3:.3g}",
                str(rt.iters),
            ]
        )
    headers = ["size", "ringtrain CPU ms/op", "torch CPU ms/op", "rt/torch CPU, paired"]
    headers += ["top rank CPU rt / torch", "wall ms rt / torch", "ops/sample"]
    p = res.params
    head = (
        f"CPU time per allreduce per rank (all threads, {p.tail_s * 1e3:.0f} ms idle tail per "
        f"sample), {res.world_size} ranks x {res.threads} torch threads, median [min-max] of "
        f"{p.repeats} samples" + _load(res.environment)
    )
    parts = [head, table(headers, rows, markdown)]
    if res.burst:
        brows = []
        for b in res.burst:
            ops = f"{b.gloo_ops:.1f}" if b.gloo_ops is not None else "-"
            brows.append([b.impl, ms(b.cpu), ratio(b), f"{b.wall.median * 1e3:.3g}", ops])
        parts.append(
            f"burst: {p.burst_count} x {fmt_bytes(p.burst_each_bytes)} allreduce_async_ then "
            "synchronize, per burst"
        )
        parts.append(
            table(
                ["case", "CPU ms/rank", "CPU vs one tensor", "wall ms", "fused Gloo ops"],
                brows,
                markdown,
            )
        )
    return "\n".join(parts)
