"""The fused path's pipeline chunk size: 1024 x 64 KiB through ``grouped_allreduce_`` against one
64 MiB ``torch.distributed.all_reduce``, at several chunk sizes, in the same ranks (``--count``
sets the tensors; ``--burst`` submits them as Horovod's usual pattern does, ``allreduce_async_``
under one name each, then ``synchronize``).

Each repeat runs torch's allreduce, then the grouped call at every chunk size (the order flips
every repeat), each 3 times back to back after a barrier; a sample is the slowest rank's time
per op. Prints the median per chunk size and the ratio to torch's sample of the same repeat
(median [min-max]). Run under the launcher, which binds each rank to its cores:

    ringtrain run -np 2 -- .venv/bin/python scripts/bench_fusion_chunks.py [--repeats 6]
    ringtrain run -np 8 -x OMP_NUM_THREADS=2 -- python scripts/bench_fusion_chunks.py \
        --count 256 --burst        # issue 38's burst, on a machine with 16 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

import ringtrain as rt
from ringtrain.bench.timing import seconds_per_op
from ringtrain.collectives import execute

CHUNKS_MIB = (1, 2, 4, 8, 16, 64)
OPS_PER_SAMPLE = 3


def _time(op: Callable[[], None]) -> float:
    return seconds_per_op(op, OPS_PER_SAMPLE)  # from a quiet process, after a barrier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--count", type=int, default=1024, help="tensors of 64 KiB")
    parser.add_argument("--burst", action="store_true", help="async ops, not one grouped call")
    args = parser.parse_args()
    rt.init()
    small = [torch.zeros(16384) for _ in range(args.count)]
    big = torch.zeros(16384 * args.count)

    def grouped() -> None:
        if not args.burst:
            rt.grouped_allreduce_(small, name="bench.chunks", op=rt.Sum)
            return
        handles = [
            rt.allreduce_async_(t, name=f"bench.chunks.{i}", op=rt.Sum) for i, t in enumerate(small)
        ]
        for h in handles:
            rt.synchronize(h)

    def one() -> None:
        dist.all_reduce(big)

    for mib in CHUNKS_MIB:  # warm-up: buffers, names, caches
        execute.PIPELINE_CHUNK_BYTES = mib << 20
        grouped()
    one()
    base: list[float] = []
    by_chunk: dict[int, list[float]] = {mib: [] for mib in CHUNKS_MIB}
    for rep in range(args.repeats):
        base.append(_time(one))
        for mib in CHUNKS_MIB if rep % 2 == 0 else CHUNKS_MIB[::-1]:
            execute.PIPELINE_CHUNK_BYTES = mib << 20
            by_chunk[mib].append(_time(grouped))
    table = torch.tensor([base] + [by_chunk[m] for m in CHUNKS_MIB], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)  # the slowest rank's samples
    if rt.rank() == 0:
        b = table[0].tolist()
        print(
            f"load average {os.getloadavg()[0]:.2f}; torch one tensor "
            f"{statistics.median(b) * 1e3:.1f} ms"
        )
        for i, mib in enumerate(CHUNKS_MIB):
            v = table[i + 1].tolist()
            r = sorted(x / y for x, y in zip(v, b))
            print(
                f"chunk {mib:>2} MiB: {statistics.median(v) * 1e3:6.1f} ms, "
                f"{statistics.median(r):.2f}x [{r[0]:.2f}-{r[-1]:.2f}]"
            )
    rt.shutdown()


if __name__ == "__main__":
    main()
