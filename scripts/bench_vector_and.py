"""CPU and wall time of one tiny bitwise-AND reduction in raw torch, three ways, at N ranks:
Gloo's ring allreduce, Gloo's ring allgather (then an AND at home), and recursive doubling on
2-rank groups (what ringtrain's vector rounds use). 2,000 ops per figure, medians of 3, the
worst rank (docs/benchmarks/log/2026-11-28-idle-naps.md).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_vector_and.py 8
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from ringtrain.host.connections import doubling_pairs, doubling_steps
from ringtrain.testing import spawn


def _measure(ops: int) -> dict[str, tuple[float, float]]:
    import psutil
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    pairs = {p: dist.new_group(list(p)) for p in doubling_pairs(size)}  # every rank, every pair
    steps = [pairs[p] for p in doubling_steps(rank, size)]
    ring = dist.new_group(list(range(size)))
    v = torch.zeros(16, dtype=torch.int64)
    out = torch.zeros(16 * size, dtype=torch.int64)

    def doubling() -> None:
        for g in steps:
            dist.all_reduce(v, op=dist.ReduceOp.BAND, group=g)

    ways: dict[str, Callable[[], object]] = {
        "ring allreduce": lambda: dist.all_reduce(v, op=dist.ReduceOp.BAND, group=ring),
        "ring allgather": lambda: dist.all_gather_into_tensor(out, v, group=ring),
        "doubling": doubling,
    }
    me = psutil.Process()
    got: dict[str, list[tuple[float, float]]] = {}
    for _ in range(3):
        for name, run in ways.items():
            for _ in range(20):
                run()
            dist.barrier(group=ring)
            cpu, started = sum(me.cpu_times()[:2]), time.perf_counter()
            for _ in range(ops):
                run()
            wall = (time.perf_counter() - started) / ops * 1e6
            got.setdefault(name, []).append(((sum(me.cpu_times()[:2]) - cpu) / ops * 1e6, wall))
    return {
        k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
        for k, v in got.items()
    }


def main(size: int) -> None:
    world = spawn.World(size)
    try:
        got = world.run(_measure, 2000, timeout=300)
    finally:
        world.close()
    for name in got[0]:
        cpu = max(r[name][0] for r in got)
        wall = max(r[name][1] for r in got)
        print(f"{size} ranks, {name}: CPU {cpu:.0f} us/op, wall {wall:.0f} us/op")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
