"""The demo with one rank slowed (issue 41): ``--batch-shares auto`` chooses the shares and says
so, the job reaches the demo's usual accuracy, and every sample of an epoch is taken once (the
ranks' samples add up to the epochs times the training split).

The slow rank sleeps as long as its forward and backward took, times ``SLOW_FACTOR - 1``, so
it stays slower whatever load the machine is under, unless the fast rank gets less than
1/SLOW_FACTOR of the CPU the slow one gets. At half speed (2) a suite's load once did that (q76:
the slow rank took 9,597 samples, the fast one 7,647); at a quarter speed it takes four times."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).parents[2] / "examples" / "train_digits.py"
EPOCHS = 12  # the demo's default
TRAIN = 1437  # scikit-learn's 1,797 digits less the demo's stratified 20% test split
SLOW_FACTOR = "4"


@pytest.mark.timeout(240)
def test_the_demo_with_a_slow_rank_and_measured_shares() -> None:
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--", sys.executable]
    argv += [str(DEMO), "--batch-shares", "auto", "--slow-rank", "1", "--slow-factor", SLOW_FACTOR]
    argv += ["--epochs", str(EPOCHS)]
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    chosen = re.search(r"batch_shares=auto: shares \[(\d+), (\d+)\] of each global batch", out)
    assert chosen, out[-4000:]
    # The first choice comes from the median of 5 steps of a few milliseconds. Beside other load
    # (the suite's, stress-ng) it has kept equal shares, and once gave the slow rank the larger
    # share ([368, 632]: the fast rank was starved of its core while measured); later
    # measurements move the shares (logged at INFO), so what each rank took over the job is
    # the outcome that counts, not the first choice.
    done = re.search(r"test accuracy: ([\d.]+)%.*samples per rank: \[(\d+), (\d+)\]", out)
    assert done, out[-4000:]
    assert float(done[1]) >= 95.0  # the demo's target; it usually reaches about 97%
    fast, slow = int(done[2]), int(done[3])
    assert fast > slow and fast + slow == EPOCHS * TRAIN  # the fast rank took more
