"""Durable jobs' launchers killed mid-run: waiting for the checkpoint to kill them after (the
durable-checkpoint tests on one host and on the namespace cluster)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from ringtrain.checkpoint import manifest


def wait_for_commit(launcher: subprocess.Popen[bytes], ck: Path, step: int) -> None:
    """Until a checkpoint of ``step`` or later is committed in ``ck``; fails if the job ends
    first or none is within 240 s."""
    deadline = time.monotonic() + 240
    while not any(s >= step for s, _ in manifest.committed(str(ck))):
        assert launcher.poll() is None, "the job ended before it could be killed"
        assert time.monotonic() < deadline, f"no checkpoint at step {step} in time"
        time.sleep(0.2)
