"""CPU per allreduce by kind of thread, plain torch.distributed or inside ringtrain, 2+ ranks
(docs/benchmarks/log/2026-11-28-gloo-loop-spin.md): where a Gloo op's CPU goes.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 2 scripts/gloo_thread_cpu.py 65536 torch
    OMP_NUM_THREADS=1 .venv/bin/ringtrain run -np 2 -- .venv/bin/python \
        scripts/gloo_thread_cpu.py 65536 ringtrain

``torch``: raw ``all_reduce`` in a process with nothing else; ``ringtrain``: raw ``all_reduce``
and ringtrain's blocking ``allreduce_`` (the fast lane) alternated in the same processes. A third
argument ``pin`` puts each rank's threads on one core of its own (rank r on core r); ``gap=30,100``
adds, per gap, cases where the caller works that many microseconds (a busy loop, as a program
computes between collectives) before each op (``raw+30us``); ``inflight=4,8`` cases where it
works that long between a raw op's start and its wait (``raw~4us``); the caller's own CPU is
left in.
Kinds of thread by the kernel's ``comm``: ``gloo_tcp_loop`` (a group's device loop: its epoll,
socket reads, and the spin on a busy pair lock), ``pt_gloo_runloop`` (a group's workers, which
run the algorithm), ``caller`` (the main thread), ``other``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

OPS = 1500
REPEATS = 3


def _cpu() -> dict[int, tuple[str, float]]:
    got = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        got[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return got


def measure(
    fn: Callable[[torch.Tensor], object], x: torch.Tensor, ops: int = OPS
) -> tuple[float, dict[str, float]]:
    """Wall ms per op and CPU ms per op by kind of thread (a 100 ms idle tail included), over
    ``ops`` calls of ``fn(x)`` after a barrier (also scripts/bench_lane_path.py's measure)."""
    dist.barrier()
    before, t0 = _cpu(), time.perf_counter()
    for _ in range(ops):
        fn(x)
    wall = time.perf_counter() - t0
    time.sleep(0.1)
    main = os.getpid()
    kinds: dict[str, float] = {}
    for tid, (name, used) in _cpu().items():
        kind = "caller" if tid == main else name if name in _KINDS else "other"
        kinds[kind] = kinds.get(kind, 0.0) + (used - before.get(tid, ("", 0.0))[1]) / ops * 1e3
    return wall / ops * 1e3, kinds


_KINDS = ("gloo_tcp_loop", "pt_gloo_runloop")


def _gaps(args: list[str], key: str = "gap=") -> list[int]:
    return [int(g) for a in args if a.startswith(key) for g in a[len(key) :].split(",")]


def _busy(us: int) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _after_gap(fn: Callable[[torch.Tensor], object], us: int) -> Callable[[torch.Tensor], object]:
    def call(t: torch.Tensor) -> object:
        _busy(us)
        return fn(t)

    return call


def _work_in_flight(us: int) -> Callable[[torch.Tensor], object]:
    """Raw ``all_reduce`` with the caller working ``us`` between the op's start and its wait."""

    def call(t: torch.Tensor) -> object:
        work = dist.all_reduce(t, async_op=True)
        _busy(us)
        assert work is not None
        return work.wait()

    return call


def main() -> None:
    size, engine = int(sys.argv[1]), sys.argv[2]
    fns: list[tuple[str, Callable[[torch.Tensor], object]]] = [("raw", dist.all_reduce)]
    if engine == "torch":
        dist.init_process_group("gloo")
        rank, end = dist.get_rank(), dist.destroy_process_group
    else:
        import ringtrain as rt
        from ringtrain.collectives import lane

        rt.init(fast_lane=True)
        lane.RELEASE_S = 60.0  # a slot that waits is not released to negotiation mid-run
        rank, end = rt.rank(), rt.shutdown
        fns.append(("lane", lambda t: rt.allreduce_(t, name="w", op=rt.Sum)))
    base = list(fns)
    for gap in _gaps(sys.argv[3:]):
        fns += [(f"{label}+{gap}us", _after_gap(fn, gap)) for label, fn in base]
    fns += [(f"raw~{us}us", _work_in_flight(us)) for us in _gaps(sys.argv[3:], "inflight=")]
    if "pin" in sys.argv[3:]:
        core = {rank % (os.cpu_count() or 1)}
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), core)
    x = torch.randn(size // 4)
    for _, fn in fns:
        for _ in range(30):
            fn(x)
    for _ in range(REPEATS):
        for label, fn in fns:
            wall, kinds = measure(fn, x)
            if rank == 0:
                parts = ", ".join(f"{k} {v:.3f}" for k, v in sorted(kinds.items()) if v > 0)
                print(
                    f"{engine} {label}: wall {wall:.3f} ms, CPU {sum(kinds.values()):.3f} ms ({parts})"
                )
    end()


if __name__ == "__main__":
    main()
