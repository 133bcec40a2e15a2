"""A job's whole life, launch to exit: ``ringtrain run`` against torchrun, alternated.

Each variant starts a 2-rank job of one 1-element allreduce (import, init, one collective,
shutdown, exit) and is timed from the launcher's start to its exit; the variants run in turn,
round after round, and the medians are printed with every run's time
(docs/benchmarks/log/2026-11-30-job-start-end.md).

    .venv/bin/python scripts/bench_job_start.py [ROUNDS]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RINGTRAIN_JOB = """
import ringtrain.torch as hvd, torch
hvd.init()
hvd.allreduce(torch.ones(1))
"""
TORCH_JOB = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
"""


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    bin_dir = Path(sys.executable).parent
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        rt_job, torch_job = Path(tmp, "rt_job.py"), Path(tmp, "torch_job.py")
        rt_job.write_text(RINGTRAIN_JOB)
        torch_job.write_text(TORCH_JOB)
        torchrun = [str(bin_dir / "torchrun"), "--nproc-per-node", "2"]
        ringtrain_run = [py, "-m", "ringtrain", "run", "-np", "2", "--"]
        variants = {
            "ringtrain run, ringtrain.torch": [*ringtrain_run, py, str(rt_job)],
            "torchrun, torch.distributed": [*torchrun, str(torch_job)],
            "torchrun, ringtrain.torch": [*torchrun, str(rt_job)],
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        for _ in range(rounds):
            for label, argv in variants.items():
                t = time.monotonic()
                subprocess.run(argv, check=True, capture_output=True, env=env, timeout=120)
                times[label].append(time.monotonic() - t)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    base = statistics.median(times["torchrun, torch.distributed"])
    for label, got in times.items():
        med = statistics.median(got)
        runs = " ".join(f"{x:.2f}" for x in got)
        print(
            f"{label:32s} median {med:.2f} s [{min(got):.2f}-{max(got):.2f}], "
            f"{med / base:.2f}x torchrun's time; runs: {runs}"
        )


if __name__ == "__main__":
    main()
