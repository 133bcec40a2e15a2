"""The latency of one tiny collective by algorithm: what a lane slot's agreement could run on.

A fast-lane slot above 1 MiB at 3+ ranks sums one value over the lane's group before its data
moves (``collectives/agreed.py``): Gloo's ring, 2(N-1) sequential steps. On 16 cores that cost
0.7-1.1 ms a slot at 8 ranks and 6-8 ms at 16 (docs/benchmarks/log/2026-12-04-16core-scale.md).
This times the candidates for that one value, interleaved in the same ranks, so the choice can
be made on a machine with a core per rank:

- ``ring``: ``all_reduce`` of one int32 (Gloo's ring, 2(N-1) steps)
- ``alltoall``: ``all_to_all_single`` of N int32 (one step, N-1 messages at once)
- ``allgather``: the one-tensor all-gather of one int32 (Gloo's ring, N-1 steps)
- ``barrier``: Gloo's dissemination barrier (log2 N steps; carries no value)
- ``doubling``: ``all_reduce`` of one int32 on 2-rank groups, rank ^ 2^i (log2 N of them, for
  a power-of-two N; the groups are made here, as the vector rounds' are)

A sample is ``--ops`` ops back to back after a barrier; the slowest rank's sample counts.
Prints each candidate's median per op [min-max] and its ratio to ``ring``'s sample of the same
repeat.

    ringtrain run -np 16 -x OMP_NUM_THREADS=1 -- python scripts/bench_tiny_latency.py
    ringtrain run -np 4 -- .venv/bin/python scripts/bench_tiny_latency.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import ringtrain as rt
from ringtrain import compat


def _pairs(rank: int, size: int) -> list[dist.ProcessGroup]:
    """This rank's 2-rank groups, level by level (every rank makes every group, in one order)."""
    mine = []
    level = 1
    while level < size:
        for r in range(size):
            if r < r ^ level < size:
                g = dist.new_group([r, r ^ level])
                if rank in (r, r ^ level):
                    mine.append(g)
        level <<= 1
    return mine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--ops", type=int, default=20, help="ops per sample")
    args = parser.parse_args()
    rt.init()  # the launcher's rendezvous; every case below is torch's own, on groups made here
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    one = torch.ones(1, dtype=torch.int32)
    row, rows = torch.ones(size, dtype=torch.int32), torch.empty(size, dtype=torch.int32)
    power = size & (size - 1) == 0
    pairs = _pairs(rank, size) if power else []

    def doubling() -> None:
        for g in pairs:
            dist.all_reduce(one, group=g)

    cases: dict[str, Callable[[], object]] = {
        "ring": lambda: dist.all_reduce(one, group=group),
        "alltoall": lambda: dist.all_to_all_single(rows, row, group=group),
        "allgather": lambda: compat.all_gather_single(rows, one, group=group),
        "barrier": lambda: dist.barrier(group=group),
    }
    if power:
        cases["doubling"] = doubling
    for op in cases.values():  # connect every group before timing
        op()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(args.repeats):
        for name in cases if rep % 2 == 0 else list(cases)[::-1]:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(args.ops):
                cases[name]()
            samples[name].append((time.perf_counter() - t0) / args.ops)
    table = torch.tensor(list(samples.values()), dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # the slowest rank's samples
    if rank == 0:
        ring = table[0].tolist()
        print(f"{size} ranks, {args.ops} ops per sample; load average {os.getloadavg()[0]:.2f}")
        for i, name in enumerate(cases):
            v = table[i].tolist()
            r = sorted(x / y for x, y in zip(v, ring))
            print(
                f"  {name:9s} {statistics.median(v) * 1e3:7.3f} ms [{min(v) * 1e3:.3f}-"
                f"{max(v) * 1e3:.3f}], {statistics.median(r):.2f}x ring's time "
                f"[{r[0]:.2f}-{r[-1]:.2f}]"
            )
    rt.shutdown()


if __name__ == "__main__":
    main()
