"""A 2-rank job's whole CPU, launch to exit, under two trees of ringtrain, alternated.

Each round runs the same job (import, init, one 1-element allreduce, exit) under
``ringtrain run -np 2`` once with each tree's ``src`` first on PYTHONPATH, and reads the CPU
(user + system) of everything the launcher started that it waited for: launcher, store, agent,
ranks. CPU, not wall time: on a shared machine load inflates wall time, not the work done
(docs/benchmarks/log/2026-12-05-store-without-torch.md).

    .venv/bin/python scripts/bench_job_cpu.py OLD_SRC NEW_SRC [ROUNDS]
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import ringtrain.torch as hvd, torch
hvd.init()
hvd.allreduce(torch.ones(1))
"""


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def main() -> None:
    trees = {"old": sys.argv[1], "new": sys.argv[2]}
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    cpu: dict[str, list[float]] = {k: [] for k in trees}
    wall: dict[str, list[float]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp, "job.py")
        job.write_text(JOB)
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        for _ in range(rounds):
            for label, src in trees.items():
                env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src}
                argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--"]
                c, t = _cpu(), time.monotonic()
                subprocess.run(
                    [*argv, sys.executable, str(job)],
                    check=True,
                    capture_output=True,
                    env=env,
                    timeout=120,
                )
                wall[label].append(time.monotonic() - t)
                cpu[label].append(_cpu() - c)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    ratios = [n / o for o, n in zip(cpu["old"], cpu["new"])]
    for label in trees:
        print(
            f"{label}: CPU {statistics.median(cpu[label]):.2f} s "
            f"[{min(cpu[label]):.2f}-{max(cpu[label]):.2f}], "
            f"wall {statistics.median(wall[label]):.2f} s "
            f"[{min(wall[label]):.2f}-{max(wall[label]):.2f}] ({trees[label]})"
        )
    print(
        f"new/old CPU, paired by round: median {statistics.median(ratios):.2f}x "
        f"[{min(ratios):.2f}-{max(ratios):.2f}], n={rounds}"
    )


if __name__ == "__main__":
    main()
