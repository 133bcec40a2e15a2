"""A durable job in the enclave sandbox: ``ringtrain run --transport tcp --checkpoint-dir D
--checkpoint-every 2`` under ``python -m ringtrain.testing.enclave --strict`` (no ``/dev/shm``,
``flock`` or fork after ``init()``) commits its checkpoints through the thread writer, and
``--resume D`` continues from the newest; likewise sealed (``--secure --key-file K``, the
setting an enclave job runs in). The process writer is killed there (SIGSYS)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _enclave import PY, STRICT
from ringtrain.checkpoint import load, manifest
from ringtrain.security.keys import generate_job_key, write_key_file

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="the enclave sandbox needs Linux seccomp and root (to hide /dev/shm)",
)
JOB = str(Path(__file__).parents[1] / "checkpoint" / "durable_job.py")


def _durable(
    flags: list[str], out: Path, steps: int, cwd: Path, writer: str = "auto"
) -> subprocess.CompletedProcess[str]:
    argv = [
        PY, "-m", "ringtrain", "run", "-np", "2", "--network-interface", "lo",
        "--transport", "tcp", "--log-level", "INFO", "--checkpoint-every", "2", *flags,
        "--", *STRICT, JOB, str(out), str(steps), "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RINGTRAIN_CHECKPOINT_WRITER": writer}
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=cwd, env=env)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_durable_job_saves_and_resumes_in_the_enclave(
    tmp_path: Path, sealed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = tmp_path / "ck"
    secure: list[str] = []
    if sealed:  # one key for both runs: a sealed checkpoint opens only under its job's key
        key = tmp_path / "job.key"
        write_key_file(str(key), generate_job_key())
        secure = ["--secure", "--key-file", str(key)]
        monkeypatch.setenv("RINGTRAIN_SECURE", "1")
        monkeypatch.setenv("RINGTRAIN_KEY_FILE", str(key))
    first = _durable([*secure, "--checkpoint-dir", str(ck)], tmp_path / "a.pt", 4, tmp_path)
    said = first.stdout + first.stderr
    assert first.returncode == 0, said
    assert said.count("the thread writer (auto: ") == 2, said  # each rank chose it
    assert [s for s, _ in manifest.committed(str(ck))] == [2, 4]
    assert manifest.read(manifest.resolve(str(ck)), secure=sealed)["sealed"] is sealed

    again = _durable([*secure, "--resume", str(ck)], tmp_path / "b.pt", 6, tmp_path)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said
    assert "rank 0 starts at step 4" in said and "rank 1 starts at step 4" in said
    assert [s for s, _ in manifest.committed(str(ck))] == [2, 4, 6]
    # The last checkpoint holds the weights the job ended with.
    final = torch.load(tmp_path / "b.pt")
    saved = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    assert load(str(ck), model=saved).step == 6
    assert all(torch.equal(a, b) for a, b in zip(final, saved.parameters()))
    if sealed:
        return
    # The reproduction: the writer process (shared memory, flock, a child process) is killed.
    denied = _durable(["--checkpoint-dir", str(tmp_path / "x")], tmp_path / "c.pt", 4, tmp_path,
                      writer="process")  # fmt: skip
    assert denied.returncode != 0
    assert "SIGSYS" in denied.stdout + denied.stderr
