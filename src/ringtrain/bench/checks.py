"""Consistency-check benchmark: what mismatch detection (``check_consistency``, on by default) costs.

With checks off, ranks still exchange every request (names are how collectives are matched), so
what checks add is :func:`ringtrain.collectives.requests.mismatch` on each collective's requests
before it runs. This benchmark shows that cost two ways:

* end to end: ringtrain allreduce time per op with checks on and off, for single tensors of a
  small and a medium size and for a *step*: ``step_tensors`` named tensors submitted
  asynchronously and then waited for, as DistributedOptimizer does with a step's gradients;
* alone: ``mismatch`` timed on this process over ``world_size`` equal requests, per collective,
  two ways: over unpickled copies (a name's first run, as requests arrive from peers) and over
  one shared object (every later run: the controller's request cache hands every rank's request
  over as the same cached object). Its share of each case's time follows from the case's
  median with checks off and the number of collectives per op.

``check_consistency`` is a property of a whole ``ringtrain.init``, so each repeat runs one phase
per setting (``shutdown``, ``init`` with it, every case), the two phases swapping order every
other repeat so both see the same machine load. Every case gets one untimed round per phase
first, each sample starts after a barrier and is the slowest rank's time. The ratio on/off is
taken per repeat from the two adjacent phases (a paired comparison), then summarized.
"""

from __future__ import annotations

import functools
import pickle
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import ringtrain
from ringtrain.bench import catalog
from ringtrain.bench.registry import register
from ringtrain.bench.stats import Summary, load_average, machine_info
from ringtrain.bench.timing import seconds_per_op
from ringtrain.bench.units import KiB, MiB
from ringtrain.collectives.requests import Request, TensorMeta, mismatch
from ringtrain.runtime import state

DEFAULT_SIZES = catalog.CHECKS_SIZES
SETTINGS = ("on", "off")
# Auto iteration count: about this many bytes per sample, between MIN_ITERS and MAX_ITERS ops,
# so a small op's sample is long enough that a few microseconds per op are not timer noise.
SAMPLE_BYTES = 16 * MiB
MIN_ITERS = 4
MAX_ITERS = 200


@dataclass(frozen=True)
class ChecksParams:
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5  # phases per setting = timed samples per case and setting
    iters: int = 0  # ops per sample; 0 picks one per size
    step_tensors: int = 256  # named tensors in the step case (0 skips it)
    step_each_bytes: int = 4 * KiB
    step_iters: int = 5  # steps per sample


@dataclass
class CheckPoint:
    """One case: seconds per op (per step for the step case) with checks on and off."""

    case: str
    tensors: int
    nbytes: int  # bytes per tensor
    iters: int
    on: Summary
    off: Summary
    # on/off of the same repeat's two phases; 1.0 = checks cost nothing measurable.
    ratio: Summary


@dataclass
class ChecksResult:
    world_size: int
    params: ChecksParams
    points: list[CheckPoint] = field(default_factory=list)
    # mismatch() alone on this machine, microseconds per collective of one tensor at this world
    # size: over the request cache's shared object (steady state) and over unpickled copies
    # (a name's first run); and those times' share of each case's median time with checks off.
    check_cached_us: Summary | None = None
    check_first_us: Summary | None = None
    share_cached: dict[str, float] = field(default_factory=dict)
    share_first: dict[str, float] = field(default_factory=dict)
    # Seconds per ringtrain.init per phase (not part of any op time).
    init_time: Summary | None = None
    environment: dict[str, Any] = field(default_factory=dict)


class _Case(NamedTuple):
    op: Callable[[], None]
    iters: int  # ops per sample
    tensors: int  # named tensors per op
    nbytes: int  # bytes per tensor


def _iters_for(nbytes: int, params: ChecksParams) -> int:
    if params.iters > 0:
        return params.iters
    return max(MIN_ITERS, min(MAX_ITERS, SAMPLE_BYTES // max(1, nbytes)))


def _switch(setting: str, base: Any) -> float:
    """Re-initialize ringtrain with checks ``setting``; returns the seconds ``init`` took."""
    ringtrain.shutdown()
    t0 = time.perf_counter()
    ringtrain.init(config=base.replace(check_consistency=setting == "on"))
    return time.perf_counter() - t0


def _allreduce(t: torch.Tensor, name: str) -> None:
    ringtrain.allreduce_(t, name=name, op=ringtrain.Sum)


def _step(tensors: list[torch.Tensor]) -> None:
    handles = [
        ringtrain.allreduce_async_(t, name=f"bench.checks.step.{i}", op=ringtrain.Sum)
        for i, t in enumerate(tensors)
    ]
    for h in handles:
        ringtrain.synchronize(h)


def _cases(params: ChecksParams) -> dict[str, _Case]:
    """The cases by label. Each sums zeros in place, so repeated rounds never overflow."""
    cases: dict[str, _Case] = {}
    for nbytes in params.sizes:
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        op = functools.partial(_allreduce, t, f"bench.checks.{nbytes}")
        cases[f"allreduce {_size(nbytes)}"] = _Case(
            op, _iters_for(nbytes, params), 1, 4 * t.numel()
        )
    if params.step_tensors > 0:
        each = max(1, params.step_each_bytes // 4)
        step = [torch.zeros(each, dtype=torch.float32) for _ in range(params.step_tensors)]
        label = f"step of {params.step_tensors} x {_size(4 * each)}"
        op = functools.partial(_step, step)
        cases[label] = _Case(op, params.step_iters, params.step_tensors, 4 * each)
    return cases


def _size(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _phase(rep: int, cases: dict[str, _Case]) -> dict[str, float]:
    """One timed sample of every case: seconds per op on this rank."""
    out: dict[str, float] = {}
    for case in cases.values():
        case.op()  # warm-up: this phase's controller has not seen these names yet
    order = list(cases) if rep % 2 == 0 else list(cases)[::-1]
    for label in order:
        out[label] = seconds_per_op(cases[label].op, cases[label].iters)
    return out


def check_cost_us(
    world_size: int, repeats: int, calls: int = 2000, cached: bool = False
) -> list[float]:
    """Microseconds per ``mismatch`` call over ``world_size`` equal one-tensor allreduce
    requests (``repeats`` samples of ``calls`` calls): each rank's an unpickled copy, or with
    ``cached`` all one object, as the request cache delivers them. Timed in this thread's CPU
    time, so other processes on a shared machine do not inflate it (wall time would)."""
    meta = (TensorMeta((1024,), "torch.float32"),)
    req = Request("model.layer.weight", "allreduce", meta, op="Average")
    ranks = range(max(1, world_size))
    by_rank = {r: req if cached else pickle.loads(pickle.dumps(req)) for r in ranks}
    times = timeit.repeat(
        lambda: mismatch(req.name, by_rank), number=calls, repeat=repeats, timer=time.thread_time
    )
    return [t / calls * 1e6 for t in times]


@register("checks")
def bench_checks(params: ChecksParams) -> ChecksResult:
    """Runs on every rank after ``ringtrain.init()``; every rank returns the same result.

    Switches checks on and off (shutdown, init) and leaves ringtrain initialized with the
    setting of the last phase.
    """
    base = state.current().config
    n = ringtrain.size()
    environment = machine_info()
    cases = _cases(params)
    local: dict[tuple[str, str], list[float]] = {}
    init_s: list[float] = []
    for rep in range(params.repeats):
        for setting in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
            init_s.append(_switch(setting, base))
            for case, seconds in _phase(rep, cases).items():
                local.setdefault((case, setting), []).append(seconds)
    alone = check_cost_us(n, params.repeats, cached=True) + check_cost_us(n, params.repeats)
    # The slowest rank's figures, sample by sample: one small allreduce, outside any timing.
    keys = [(c, s) for c in cases for s in SETTINGS]
    flat = [x for k in keys for x in local[k]] + init_s + alone
    slowest = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = slowest.tolist()
    r = params.repeats
    samples = {k: values[i * r : (i + 1) * r] for i, k in enumerate(keys)}
    rest = values[len(keys) * r :]
    result = ChecksResult(n, params, environment=environment)
    result.init_time = Summary.of(rest[: len(init_s)])
    result.check_cached_us = Summary.of(rest[len(init_s) : len(init_s) + r])
    result.check_first_us = Summary.of(rest[len(init_s) + r :])
    for label, c in cases.items():
        on, off = samples[(label, "on")], samples[(label, "off")]
        ratio = Summary.of([a / b for a, b in zip(on, off) if b > 0] or [0.0])
        result.points.append(
            CheckPoint(label, c.tensors, c.nbytes, c.iters, Summary.of(on), Summary.of(off), ratio)
        )
        per_collective_s = Summary.of(off).median / c.tensors
        if per_collective_s > 0:
            result.share_cached[label] = result.check_cached_us.median * 1e-6 / per_collective_s
            result.share_first[label] = result.check_first_us.median * 1e-6 / per_collective_s
    result.environment["load_after"] = load_average()
    return result
