"""Helpers for the discovery-script tests (tests/elastic and tests/cluster): run
``tests/elastic/grow_job.py`` under ``ringtrain run``, read its lines, write discovery scripts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).parent / "elastic" / "grow_job.py"
N, EPOCHS = 60, 2  # as in grow_job.py
# (count, sum, sum of squares) of samples 1..N, each trained on once per epoch
EXPECTED = str([N * EPOCHS, EPOCHS * N * (N + 1) // 2, EPOCHS * N * (N + 1) * (2 * N + 1) // 6])
EXPECTED = EXPECTED.replace(" ", "")


def fields(out: str, kind: str) -> list[dict[str, str]]:
    return [
        dict(re.findall(r"(\w+)=(\S+)", line))
        for line in out.splitlines()
        if re.match(rf"\[\d+\] {kind} ", line)
    ]


def script(tmp: Path, before: str, after: str) -> str:
    """A discovery script printing ``before`` until ``tmp/signal`` exists, then ``after``."""
    path = tmp / "discover.sh"
    path.write_text(
        f"#!/bin/sh\nif [ -e {tmp}/signal ]; then printf '{after}'; else printf '{before}'; fi\n"
    )
    path.chmod(0o755)
    return str(path)


def job_command(
    tmp: Path, flags: list[str], launcher: list[str] | None = None, **env_vars: str
) -> tuple[list[str], dict[str, str]]:
    """``ringtrain run`` of elastic_job.py with ``tmp``'s signal and fails files, its variables
    forwarded to the ranks: the command and its environment."""
    env_vars = {
        "OMP_NUM_THREADS": "1",
        "MODE": "optimizer",
        "SIGNAL_FILE": str(tmp / "signal"),
        "FAILS_FILE": str(tmp / "fails"),
        **env_vars,
    }
    forward = [a for name in env_vars for a in ("-x", name)]
    argv = [sys.executable, "-m", "ringtrain", "run", *(launcher or []), *flags, *forward]
    return [*argv, "--", sys.executable, str(JOB)], {**os.environ, **env_vars}


def run_job(
    tmp: Path, flags: list[str], launcher: list[str] | None = None, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    argv, env = job_command(tmp, flags, launcher, **env_vars)
    return subprocess.run(argv, capture_output=True, text=True, timeout=400, env=env)
