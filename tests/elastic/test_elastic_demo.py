"""The elastic demo (examples/train_digits_elastic.py): a rank SIGKILLed mid-run, the others
finish in place and reach the accuracy of an undisturbed run."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

DEMO = Path(__file__).parents[2] / "examples" / "train_digits_elastic.py"
EPOCHS = 12  # the demo default


def _start() -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "3", "--min-np", "2"]
    argv += ["--", sys.executable, str(DEMO), "--epochs", str(EPOCHS), "--target-accuracy", "0"]
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _rank_pid(launcher: int, identity: int) -> int:
    """The pid of the rank that started as ``identity``, found among the launcher's children."""
    for p in psutil.Process(launcher).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if str(DEMO) in p.cmdline() and p.environ().get("RINGTRAIN_ELASTIC_ID") == str(
                identity
            ):
                return p.pid
    raise AssertionError(f"no rank with identity {identity} under launcher {launcher}")


def _accuracy(out: str) -> tuple[int, float]:
    m = re.search(r"\[0\] ranks: (\d+)  test accuracy: ([\d.]+)%", out)
    assert m, out
    return int(m[1]), float(m[2])


@pytest.mark.timeout(600)
def test_demo_survives_a_killed_rank_with_the_undisturbed_accuracy() -> None:
    undisturbed = _start()
    out, err = undisturbed.communicate(timeout=280)
    assert undisturbed.returncode == 0, out + err
    size, baseline = _accuracy(out)
    assert size == 3 and baseline >= 95.0

    proc = _start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[0] epoch 2/"):  # mid-run: epoch 3 has begun
                time.sleep(0.5)  # into the epoch, past a commit or two
                os.kill(_rank_pid(proc.pid, 1), signal.SIGKILL)
                break
        rest, err = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out + err
    assert "re-forming the world with the 2 remaining rank(s) [0, 2]" in err
    assert "world re-formed: 2 ranks" in out
    size, accuracy = _accuracy(out)
    assert size == 2
    # The same model trained on the same samples: as good as undisturbed (small differences
    # come from the smaller world's batches after the change).
    print(f"test accuracy: undisturbed {baseline}%, a rank killed mid-run {accuracy}%")
    assert accuracy >= 95.0 and accuracy >= baseline - 2.0, (baseline, accuracy)
