"""Durable jobs' launchers killed mid-run: waiting for the checkpoint to kill them after (the
durable-checkpoint tests on one host and on the namespace cluster), or for their ranks to start
(durable_job.py's first line) to signal them then."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from ringtrain.checkpoint import manifest


def wait_for_commit(launcher: subprocess.Popen[bytes], ck: Path, step: int) -> None:
    """Until a checkpoint of ``step`` or later is committed in ``ck``; fails if the job ends
    first or none is within 240 s."""
    deadline = time.monotonic() + 240
    while not any(s >= step for s, _ in manifest.committed(str(ck))):
        assert launcher.poll() is None, "the job ended before it could be killed"
        assert time.monotonic() < deadline, f"no checkpoint at step {step} in time"
        time.sleep(0.2)


def until_started(launcher: subprocess.Popen[Any], ranks: int = 2) -> None:
    """Until ``ranks`` ranks of durable_job.py said they start (their first step is next), read
    from the launcher's output (text or bytes); fails if it ends first."""
    assert launcher.stdout is not None
    started: list[str] = []
    while len(started) < ranks:
        line = launcher.stdout.readline()
        assert line, "the job ended before its ranks started:\n" + "".join(started)
        text = line.decode(errors="replace") if isinstance(line, bytes) else line
        started += [text] if " starts at step " in text else []
