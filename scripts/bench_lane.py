"""Paired check of the fast lane against bare Gloo at one size (docs/benchmarks.md).

    ringtrain run -np 2 -- python scripts/bench_lane.py 262144
    ringtrain run --ssh-config-file CLUSTER/ssh_config -H h0:1,h1:1 -- python scripts/bench_lane.py 262144

Cases, interleaved (order reversed every other repeat), each sample 10 ops after a quiet start
and a barrier: ``torch.distributed.all_reduce`` on the default group, the same on the process
set's ``lane`` group, and ``ringtrain.allreduce_`` with a repeated name (it rides the lane).
Rank 0 prints the median ms per op and every sample, sorted; every rank its lane slots.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

import ringtrain
from ringtrain.collectives.ops import controller_of

REPEATS = 20
ITERS = 10


def main() -> None:
    torch.set_num_threads(1)
    ringtrain.init()
    ctl = controller_of(None)
    lane_group = ctl.comm.group("lane")
    n = int(sys.argv[1]) // 4 if len(sys.argv) > 1 else 65536
    a, b = torch.zeros(n), torch.zeros(n)
    cases = {
        "torch default group": lambda: dist.all_reduce(b),
        "torch lane group": lambda: dist.all_reduce(b, group=lane_group),
        "ringtrain lane": lambda: ringtrain.allreduce_(a, name="bench.lane", op=ringtrain.Sum),
    }
    for _ in range(4):
        cases["ringtrain lane"]()
    res: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(REPEATS):
        for k in list(cases) if rep % 2 else list(cases)[::-1]:
            ctl.settle()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(ITERS):
                cases[k]()
            res[k].append((time.perf_counter() - t0) / ITERS * 1000)
    if dist.get_rank() == 0:
        for k, v in res.items():
            print(f"{k}: {statistics.median(v):.3f} ms", [round(x, 2) for x in sorted(v)])
    print("rank", dist.get_rank(), "lane slots (valid, not valid):", ctl.lane_slots)
    ringtrain.shutdown()


if __name__ == "__main__":
    main()
