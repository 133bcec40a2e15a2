"""CPU per burst by thread: Horovod's usual pattern (``count`` named ``allreduce_async_`` of 64 KiB,
then ``synchronize`` each) against one blocking allreduce of the same bytes, alternated in the
same processes (docs/benchmarks/log/2026-11-29-resubmit.md): the caller's Python, the
controller's (negotiation, packing and unpacking), and the rest (Gloo's threads).

    OMP_NUM_THREADS=1 .venv/bin/ringtrain run -np 2 -- .venv/bin/python \
        scripts/bench_burst_threads.py 256

Per-thread CPU from the kernel's scheduler statistics (``/proc/self/task/*/schedstat``, in
nanoseconds; psutil's clock ticks elsewhere, 10 ms steps), summed over 40 bursts per sample
and 6 samples per case after a barrier and a short sleep; medians printed by rank 0.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

import ringtrain.torch as hvd

NUMEL = 16384  # 64 KiB of float32
PER_SAMPLE = 40
SAMPLES = 6
TASKS = Path("/proc/self/task")


def _by_thread() -> dict[str, float]:
    """CPU seconds so far by thread name (threads torch started count as "native")."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid, spent in _cpu_by_tid().items():
        key = names.get(tid, "native")
        out[key] = out.get(key, 0.0) + spent
    return out


def _cpu_by_tid() -> dict[int, float]:
    if any(TASKS.glob("*/schedstat")):
        out: dict[int, float] = {}
        for task in TASKS.iterdir():
            try:  # the first field: nanoseconds on a CPU
                out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                continue  # the thread ended meanwhile
        return out
    return {th.id: th.user_time + th.system_time for th in psutil.Process().threads()}


def main(count: int) -> None:
    hvd.init()
    parts = [torch.ones(NUMEL) for _ in range(count)]
    whole = torch.ones(NUMEL * count)

    def burst() -> None:
        handles = [
            hvd.allreduce_async_(t, name=f"burst.{i}", op=hvd.Sum) for i, t in enumerate(parts)
        ]
        for h in handles:
            hvd.synchronize(h)

    def one() -> None:
        hvd.allreduce_(whole, name="whole", op=hvd.Sum)

    cases: dict[str, Callable[[], None]] = {"burst": burst, "one tensor": one}
    for _ in range(5):  # warm: every name cached, the buffers made
        burst()
        one()
    ms: dict[str, dict[str, list[float]]] = {case: {} for case in cases}
    for _ in range(SAMPLES):
        for case, run in cases.items():
            hvd.barrier()
            time.sleep(0.05)
            before = _by_thread()
            for _ in range(PER_SAMPLE):
                run()
            time.sleep(0.1)  # the idle tail: controllers' rounds and spinning threads
            after = _by_thread()
            for name, spent in after.items():
                per = (spent - before.get(name, 0.0)) / PER_SAMPLE * 1e3
                ms[case].setdefault(name, []).append(per)
    if hvd.rank() == 0:
        for case, threads in ms.items():
            medians = {name: statistics.median(v) for name, v in threads.items()}
            parts_ = ", ".join(
                f"{name} {v:.2f}" for name, v in sorted(medians.items()) if v >= 0.005
            )
            print(f"{case}: {sum(medians.values()):.2f} ms CPU per burst ({parts_})")
    hvd.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
