"""``ringtrain bench cpu`` as a CI smoke test: tiny settings, structure and sanity, no timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain import cli


@pytest.mark.timeout(300)
def test_cpu_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "cpu.json"
    argv = ["bench", "cpu", "-np", "2", "--threads", "1", "--sizes", "64K,256K", "--repeats", "2"]
    argv += ["--iters", "3", "--tail-ms", "5", "--burst-count", "4", "--json", str(out_json)]
    assert cli.main(argv) == 0

    printed = capsys.readouterr().out
    assert "rt/torch CPU, paired" in printed and "fused Gloo ops" in printed
    res = json.loads(out_json.read_text())["result"]
    assert res["world_size"] == 2 and res["threads"] == 1
    points = {(p["impl"], p["nbytes"]): p for p in res["sizes"]}
    assert set(points) == {(i, b) for i in ("ringtrain", "torch") for b in (65536, 262144)}
    for p in points.values():
        assert p["cpu"]["n"] == 2 and p["cpu"]["min"] > 0 and p["wall"]["min"] > 0
        assert p["cpu_top_rank"]["median"] >= p["cpu"]["min"]
        assert p["paired"]["n"] == 2
    burst = {p["impl"]: p for p in res["burst"]}
    assert set(burst) == {"ringtrain async", "torch one tensor"}
    # Two ranks fuse freely: the 4 async ops of a burst take at most 4 Gloo ops.
    assert 0 < burst["ringtrain async"]["gloo_ops"] <= 4


def test_cpu_cli_refuses_a_plot(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "cpu", "--plot", "x.png"]) == 2
    assert "no plot" in capsys.readouterr().err
