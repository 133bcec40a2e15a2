"""``ringtrain bench checkpoint`` runs and reports its figures (a smoke test: no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def _bench(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "ringtrain", "bench", "checkpoint", "-np", "2",
            "--model", "mlp-1m", "--steps", "2", *flags,
        ],
        capture_output=True, text=True, timeout=270,
    )  # fmt: skip


def test_bench_checkpoint_smoke(tmp_path: Path) -> None:
    out, where = tmp_path / "ckpt.json", tmp_path / "saves" / "mlp"  # made by the first run
    proc = _bench("--rounds", "2", "--json", str(out), "--dir", str(where))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Again into the same --dir: each run saves into a folder of its own (a checkpoint
    # directory holds one run, and the first run's steps would be refused to the second).
    again = _bench("--rounds", "1", "--dir", str(where), "--writer", "thread")
    assert again.returncode == 0, again.stdout + again.stderr
    assert len([p for p in where.iterdir() if p.is_dir()]) == 2
    assert "the process writer" in proc.stdout and "the thread writer" in again.stdout
    assert "blocked per save (ms)" in proc.stdout and "slowdown (writing / idle)" in proc.stdout
    result = json.loads(out.read_text())["result"]
    assert result["world_size"] == 2 and result["checkpoint_bytes"] > 4_000_000
    assert result["blocked_s"]["n"] == 2 and result["step_idle_s"]["n"] == 4


def test_a_file_given_as_the_folder_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    proc = _bench("--dir", str(taken))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--dir {taken}: {taken} is a file, not a directory" in proc.stderr
    assert "HINT" in proc.stderr and "Traceback" not in proc.stderr
    assert taken.read_text() == "mine"
