"""Where a lane allreduce's time goes, beside raw torch.distributed, at 2 ranks
(docs/benchmarks/log/2026-11-28-lane-path.md). Three measures, one run:

1. ringtrain's own per-op cost with the wire faked (the lane group's allreduce returns a work
   that is already complete): the Python of one blocking ``allreduce_``, hot in cache;
2. one op's segments with the real wire, medians: before the data leaves (Python and torch's
   submission), in flight, after it lands; raw ``all_reduce``'s whole op beside it;
3. CPU per op by kind of thread, ringtrain's and raw's alternated: the caller's, Gloo's device
   loops (where most of it goes on a busy machine: docs/benchmarks/log/2026-11-28-gloo-loop-spin.md),
   Gloo's workers, the rest.

    OMP_NUM_THREADS=1 .venv/bin/ringtrain run -np 2 -- .venv/bin/python scripts/bench_lane_path.py 65536
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import ringtrain as rt
from ringtrain.collectives import lane
from ringtrain.collectives.ops import controller_of

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_thread_cpu import measure  # a script beside this one

OPS = 500


class _Done:
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


class _NoWire:
    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        return _Done()


class _Timed:
    """The lane's group, noting when each allreduce was handed to torch and when it returned."""

    def __init__(self, group: Any) -> None:
        self.group, self.handed, self.submitted = group, 0.0, 0.0

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        self.handed = time.perf_counter()
        work = self.group.allreduce(tensors, opts)
        self.submitted = time.perf_counter()
        return work


def _ours(x: torch.Tensor) -> None:
    rt.allreduce_(x, name="w", op=rt.Sum)


def _lane_sum() -> Any:
    """The lane's prepared sum, whose group the measures below replace."""
    fast = controller_of(None)._fast
    assert fast is not None, "the lane is off"
    return fast.lane._sum


def without_wire(x: torch.Tensor) -> float:
    wire = _lane_sum()
    real, wire._group = wire._group, _NoWire()
    try:
        t0 = time.perf_counter()
        for _ in range(5 * OPS):
            _ours(x)
        return (time.perf_counter() - t0) / (5 * OPS)
    finally:
        wire._group = real


def segments(x: torch.Tensor) -> dict[str, float]:
    wire = _lane_sum()
    timed = _Timed(wire._group)
    wire._group = timed
    got: dict[str, list[float]] = {"to torch": [], "torch submit": [], "rest": [], "raw op": []}
    dist.barrier()  # the ranks leave the faked loop apart
    try:
        for _ in range(OPS):
            t0 = time.perf_counter()
            _ours(x)
            t1 = time.perf_counter()
            got["to torch"].append(timed.handed - t0)
            got["torch submit"].append(timed.submitted - timed.handed)
            got["rest"].append(t1 - timed.submitted)
    finally:
        wire._group = timed.group
    dist.barrier()
    for _ in range(OPS):
        t0 = time.perf_counter()
        dist.all_reduce(x)
        got["raw op"].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> None:
    rt.init(fast_lane=True)
    x = torch.randn(int(sys.argv[1]) // 4 if len(sys.argv) > 1 else 16384)
    saved, lane.RELEASE_S = lane.RELEASE_S, 60.0
    for _ in range(30):
        _ours(x)
        dist.all_reduce(x)
    alone = without_wire(x)
    segs = segments(x)
    raw = lambda t: dist.all_reduce(t)  # noqa: E731
    by_thread = [measure(f, x, OPS)[1] for f in (raw, _ours, raw, _ours)]
    lane.RELEASE_S = saved
    if rt.rank() == 0:
        print(f"ringtrain per op, wire faked: {alone * 1e6:.1f} us (hot Python)")
        print(
            "with the wire (median ms): " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in segs.items())
        )
        for name, kinds in zip(["raw", "ringtrain", "raw", "ringtrain"], by_thread):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(kinds.items()))
            print(f"{name}: CPU per op {sum(kinds.values()):.3f} ms ({parts})")
    rt.shutdown()


if __name__ == "__main__":
    main()
