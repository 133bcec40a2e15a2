"""Raw Gloo allreduce with its device loop threads at another nice value, alternated in the
same 2 processes (docs/benchmarks/log/2026-11-30-gloo-loop-nice.md): how much of a small op's
CPU and wall time is the loop's spin on its pair's lock (2026-11-28-gloo-loop-spin.md).

    .venv/bin/python scripts/gloo_loop_nice.py 65536 bind 19

Arguments: bytes per op; ``bind`` (rank r on core r, as ``ringtrain run`` binds 2 ranks on 2
cores) or ``nobind``; the nice value to compare with 0. Prints, per rank and nice value, CPU
(every thread of the process) and wall microseconds per op over 6 samples, sorted.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PORT = 29557


def _loops() -> list[int]:
    found = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "gloo_tcp_loop":
                    found.append(int(tid))
        except OSError:
            continue  # ended meanwhile
    return found


def _set_nice(value: int) -> None:
    for tid in _loops():
        os.setpriority(os.PRIO_PROCESS, tid, value)  # per thread on Linux


def _rank(rank: int, size: int, nbytes: int, bind: bool, nice: int, out: Any) -> None:
    torch.set_num_threads(1)
    if bind:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=size)
    x = torch.zeros(nbytes // 4)
    ops = max(20, min(1000, (64 << 20) // nbytes))
    got: dict[int, list[tuple[float, float]]] = {}
    for rep in range(6):
        for value in (0, nice) if rep % 2 == 0 else (nice, 0):
            _set_nice(value)  # lowering it again needs CAP_SYS_NICE (root)
            for _ in range(20):
                dist.all_reduce(x)
            dist.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(ops):
                dist.all_reduce(x)
            wall = time.perf_counter() - wall
            time.sleep(0.05)  # the idle tail: a spin after the last op counts
            cpu = time.process_time() - cpu
            got.setdefault(value, []).append((cpu / ops * 1e6, wall / ops * 1e6))
    out.put((rank, got))
    dist.destroy_process_group()


def main() -> None:
    nbytes, bind, nice = int(sys.argv[1]), sys.argv[2] == "bind", int(sys.argv[3])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, nbytes, bind, nice, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    for rank, got in results:
        for value, samples in got.items():
            cpu = sorted(round(c) for c, _ in samples)
            wall = sorted(round(w) for _, w in samples)
            print(f"rank {rank} nice {value:3d}: CPU us/op {cpu}, wall us/op {wall}")


if __name__ == "__main__":
    main()
