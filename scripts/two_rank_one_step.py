"""Two ranks: Gloo's ring allreduce (two steps of half the buffer) against one
``all_gather_into_tensor`` and a local add (one step of the whole buffer), alternated in the
same processes (docs/benchmarks/log/2026-12-01-two-rank-one-step.md). At 2 ranks both sum
``a + b``, the same bits; the one step would also let the fast lane see a peer's dummy before
anything lands in the tensor.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 scripts/two_rank_one_step.py

Each rank is bound to a core of its own (as ``ringtrain run`` binds 2 ranks on 2 cores). Prints,
per size, the process CPU (every thread, a 100 ms idle tail included) and wall time per op, and
the one step's CPU over the ring's, paired sample by sample: median [min-max] of 6.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

SIZES = (16384, 65536, 262144)  # float32 elements: 64 KiB, 256 KiB, 1 MiB
SAMPLES = 6
TAIL_S = 0.1


def _sample(kind: str, n: int, ops: int, rank: int) -> tuple[float, float]:
    t = torch.full((n,), float(rank + 1))
    rows = torch.empty(2, n)
    dist.barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(ops):
        if kind == "ring":
            dist.all_reduce(t)
        else:
            dist.all_gather_into_tensor(rows.view(-1), t)
            torch.add(rows[0], rows[1], out=t)
    wall = time.perf_counter() - w0
    time.sleep(TAIL_S)
    return (time.process_time() - c0) / ops * 1e3, wall / ops * 1e3


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    got: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for n in SIZES:
        ops = 400 if n < 262144 else 150
        for s in range(SAMPLES):
            for kind in ("ring", "one step") if s % 2 == 0 else ("one step", "ring"):
                got.setdefault((n, kind), []).append(_sample(kind, n, ops, rank))
    if rank == 0:
        for n in SIZES:
            ring, one = got[(n, "ring")], got[(n, "one step")]
            ratios = [a[0] / b[0] for a, b in zip(one, ring)]
            print(
                f"{n * 4 // 1024} KiB: ring CPU {statistics.median(x[0] for x in ring):.3f} ms, "
                f"wall {statistics.median(x[1] for x in ring):.3f} | one step CPU "
                f"{statistics.median(x[0] for x in one):.3f}, wall "
                f"{statistics.median(x[1] for x in one):.3f} | CPU one step / ring "
                f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
