"""The rank-ordered sum (collectives/ordered.py) whole or in pipelined pieces, against Gloo's ring
allreduce of the same buffer, interleaved in the same ranks: wall time and the process's CPU per
op, medians over the repeats, and the paired ratio to the ring's wall time. Every variant must
give the same bits (checked on every op): a piece changes no sum.

    OMP_NUM_THREADS=1 .venv/bin/ringtrain run -np 3 -- .venv/bin/python \
        scripts/bench_ordered_pieces.py --mib 16 --pieces 0,4,2

``--pieces``: ``ordered.PIECE_BYTES`` in MiB, 0 for whole (the default there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ringtrain as rt
from ringtrain.collectives import ordered

OPS = 5  # per sample


def _time(run: object, x: torch.Tensor, t: torch.Tensor) -> tuple[float, float]:
    """Wall and CPU ms per op of ``run(t)`` (``t`` refilled from ``x`` before each)."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(OPS):
        t.copy_(x)
        run(t)  # type: ignore[operator]
    return (time.perf_counter() - t0) / OPS * 1e3, (time.process_time() - c0) / OPS * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16.0, help="buffer size")
    parser.add_argument("--pieces", default="0,4,2", help="piece sizes in MiB, 0: whole")
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    rt.init()
    x = torch.randn(int(args.mib * (1 << 20)) // 4)
    group = rt.global_process_set.communicator.group_for(x)
    scratch, t = ordered.Scratch(), x.clone()
    variants = [int(float(p) * (1 << 20)) for p in args.pieces.split(",")]
    walls: dict[int, list[float]] = {v: [] for v in variants}
    cpus: dict[int, list[float]] = {v: [] for v in variants}
    ring_wall: list[float] = []
    ring_cpu: list[float] = []
    reference = None
    for _ in range(args.repeats):
        for v in variants:
            ordered.PIECE_BYTES = v
            wall, cpu = _time(lambda b: ordered.allreduce(b, "Sum", group, scratch), x, t)
            walls[v].append(wall)
            cpus[v].append(cpu)
            reference = t.clone() if reference is None else reference
            assert torch.equal(t, reference), f"pieces of {v} bytes changed the sum's bits"
        wall, cpu = _time(lambda b: dist.all_reduce(b, group=group), x, t)
        ring_wall.append(wall)
        ring_cpu.append(cpu)
    if rt.rank() == 0:
        med = statistics.median
        print(
            f"{rt.size()} ranks, {args.mib:g} MiB float32, medians of {args.repeats} x {OPS} ops: "
            f"Gloo's ring {med(ring_wall):.1f} ms wall, {med(ring_cpu):.1f} ms CPU"
        )
        for v in variants:
            ratios = [w / r for w, r in zip(walls[v], ring_wall)]
            name = f"pieces of {v / (1 << 20):g} MiB" if v else "whole"
            print(
                f"  rank-ordered, {name}: {med(walls[v]):.1f} ms wall, {med(ratios):.2f}x the "
                f"ring's [{min(ratios):.2f}-{max(ratios):.2f}], {med(cpus[v]):.1f} ms CPU"
            )
    rt.shutdown()


if __name__ == "__main__":
    main()
