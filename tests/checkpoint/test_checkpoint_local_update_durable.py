"""A durable job with local updates: ``ringtrain run --checkpoint-dir D --checkpoint-every 2``
with ``sync_every=4`` saves mid-round; a job stopped after step 7 (its last checkpoint at step 6,
mid-round) and continued with ``ringtrain run --resume D`` ends with every rank's weights those
of the uninterrupted run, bit for bit.

The job is tests/checkpoint/durable_job.py in its ``local`` mode (each rank writes OUT.<rank>).
Its ranks save with the thread writer (``RINGTRAIN_CHECKPOINT_WRITER``): what a checkpoint holds
is the writers' common part, and a writer process per rank would cost each of the three jobs two
more torch imports. Durable jobs with writer processes: test_checkpoint_durable.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(600)
JOB = str(Path(__file__).with_name("durable_job.py"))


def _run(*flags: str, out: Path, steps: int) -> str:
    argv = [
        sys.executable, "-m", "ringtrain", "run", "-np", "2", *flags,
        "--", sys.executable, JOB, str(out), str(steps), "0", "local",
    ]  # fmt: skip
    env = {**os.environ, "RINGTRAIN_CHECKPOINT_WRITER": "thread"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_durable_local_update_job_resumes_mid_round(tmp_path: Path) -> None:
    from ringtrain.checkpoint import manifest

    _run("--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "2",
         out=tmp_path / "a", steps=10)  # fmt: skip
    ck = tmp_path / "b"
    _run("--checkpoint-dir", str(ck), "--checkpoint-every", "2", out=tmp_path / "stopped", steps=7)
    assert max(s for s, _ in manifest.committed(str(ck))) == 6  # mid-round: 6 % 4 != 0
    text = _run("--resume", str(ck), "--checkpoint-every", "2", out=tmp_path / "b", steps=10)
    assert "starts at step 6" in text
    for r in range(2):
        want = torch.load(f"{tmp_path / 'a'}.{r}")
        got = torch.load(f"{tmp_path / 'b'}.{r}")
        for a, b in zip(want, got):
            assert torch.equal(a, b), f"rank {r}: resumed weights differ"
    first = torch.load(f"{tmp_path / 'a'}.0")[0]
    assert not torch.equal(first, torch.load(f"{tmp_path / 'a'}.1")[0])  # 10 % 4: mid-round
