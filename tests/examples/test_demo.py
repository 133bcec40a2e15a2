"""What ``make demo`` runs, with the demo's defaults: ``ringtrain run -np 4 -- python
examples/train_digits.py``. It ends with exit 0 and prints the loss, a test accuracy at or
above the demo's own target (the demo exits non-zero below it) and samples/s (README)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).parents[2] / "examples" / "train_digits.py"
TARGET = 95.0  # train_digits.py's --target-accuracy default (0.95)


@pytest.mark.timeout(240)
def test_make_demo_trains_to_the_target(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "4", "--", sys.executable, str(DEMO)]
    # --save only moves rank 0's weights off the shared /tmp default; training is the same.
    argv += ["--save", str(tmp_path / "digits.pt")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    done = re.search(
        r"ranks: 4  final loss: ([\d.]+)  test accuracy: ([\d.]+)%  "
        r"throughput: ([\d,]+) samples/s",
        out,
    )
    assert done, out[-4000:]
    assert float(done[2]) >= TARGET
    assert float(done[1]) > 0 and int(done[3].replace(",", "")) > 0
