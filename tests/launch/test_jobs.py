"""Real ringtrain jobs under ``ringtrain run``: the smoke check and an unchanged Horovod script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent


def _run(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
    )


def test_check_runs_a_smoke_allreduce() -> None:
    proc = _run("-np", "2", "--check")
    assert proc.returncode == 0, proc.stderr
    assert "[0] ringtrain check OK: 2 rank(s)" in proc.stdout


def test_horovod_script_runs_unchanged_after_the_import_swap(tmp_path: Path) -> None:
    source = (HERE / "horovod_train.py").read_text()
    assert source.count("import horovod.torch as hvd") == 1
    script = tmp_path / "train.py"
    script.write_text(
        source.replace("import horovod.torch as hvd", "import ringtrain.torch as hvd")
    )
    proc = _run(
        "-np", "2", "--", sys.executable, str(script), "--checkpoint", "ck.pt", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[0] epoch 2 loss" in proc.stdout and "[0] DONE True" in proc.stdout
    assert "[1] epoch" not in proc.stdout  # only rank 0 prints and checkpoints
    ckpt = torch.load(tmp_path / "ck.pt")
    assert ckpt["epoch"] == 2 and "0.weight" in ckpt["model"]
