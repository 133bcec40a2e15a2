"""``ringtrain bench checkpoint`` runs and reports its figures (a smoke test: no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def test_bench_checkpoint_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ckpt.json"
    proc = subprocess.run(
        [
            sys.executable, "-m", "ringtrain", "bench", "checkpoint", "-np", "2",
            "--model", "mlp-1m", "--rounds", "2", "--steps", "2", "--json", str(out),
        ],
        capture_output=True, text=True, timeout=550,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "blocked per save (ms)" in proc.stdout and "slowdown (writing / idle)" in proc.stdout
    result = json.loads(out.read_text())["result"]
    assert result["world_size"] == 2 and result["checkpoint_bytes"] > 4_000_000
    assert result["blocked_s"]["n"] == 2 and result["step_idle_s"]["n"] == 4
