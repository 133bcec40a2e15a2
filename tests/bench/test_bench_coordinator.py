"""``ringtrain bench coordinator``: gathered and vector rounds side by side, in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain import cli


def test_prints_both_kinds_of_round_and_saves_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "coord.json"
    argv = ["bench", "coordinator", "--ranks", "8,32", "--ops", "0,4", "--rounds", "2"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("| gathered |") == 4 and printed.count("| vector |") == 4
    rows = json.loads(out.read_text())["rows"]
    by = {(r["size"], r["ops"], r["vectors"]): r for r in rows}
    # A gathered round's ring: N-1 steps; a vector round's recursive doubling: 2 log2 N.
    assert by[(32, 4, False)]["steps"] == 31 and by[(32, 4, True)]["steps"] == 10
    assert by[(32, 4, True)]["bytes_in"] < by[(32, 4, False)]["bytes_in"] / 100


def test_bad_rank_counts_are_explained(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "coordinator", "--ranks", "0"]) == 2
    assert "--ranks takes whole numbers of at least 1, comma separated; got '0'" in (
        capsys.readouterr().err
    )
