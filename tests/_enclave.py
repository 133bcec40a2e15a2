"""Helpers for the enclave tests: run ``tests/security/enclave_job.py`` under ``ringtrain run``,
inside or outside the sandbox, and compare what the ranks saved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

PY = sys.executable
JOB = str(Path(__file__).parent / "security" / "enclave_job.py")
SANDBOX = [PY, "-m", "ringtrain.testing.enclave"]
STRICT = [*SANDBOX, "--strict"]


def run_job(
    launcher_args: list[str], out: Path, sandbox: list[str] | None, cwd: Path, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``ringtrain run LAUNCHER_ARGS -- [SANDBOX] enclave_job.py OUT``; ranks save into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [PY, "-m", "ringtrain", "run", *launcher_args, "--", *(sandbox or [PY]), JOB, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def load(out: Path, size: int) -> list[dict[str, Any]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(size)]


def assert_same_results(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    """Exactly the same collectives' results and trained weights, rank by rank (two ranks: the
    ring sums in Gloo's order)."""
    for rank, (r, g) in enumerate(zip(ref, got)):
        for key in ("collectives", "process_set", "async", "weights"):
            _same(r[key], g[key], f"rank {rank}: {key}")


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
