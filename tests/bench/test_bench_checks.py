"""``ringtrain bench checks`` as a smoke test: tiny settings, 2 ranks, structure, never timings.

Also the pure side of what it measures: the check's happy path answers None for equal requests,
including the shared object that comes from the request cache, and still finds a difference.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.bench.checks import check_cost_us
from ringtrain.collectives.requests import Request, TensorMeta, mismatch

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_checks_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "checks.json", tmp_path / "checks.png"
    argv = ["bench", "checks", "-np", "2", "--sizes", "4K", "--repeats", "2", "--iters", "3"]
    argv += ["--step-tensors", "8", "--step-size", "1K", "--step-iters", "1"]
    argv += ["--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0

    printed = capsys.readouterr().out
    assert "checks on ms" in printed and "on/off" in printed and "the check alone" in printed
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    data = json.loads(out_json.read_text())
    assert data["benchmark"] == "checks"
    res = data["result"]
    assert res["world_size"] == 2 and res["environment"]["backend"] == "gloo"
    points = {p["case"]: p for p in res["points"]}
    assert set(points) == {"allreduce 4 KiB", "step of 8 x 1 KiB"}
    assert points["step of 8 x 1 KiB"]["tensors"] == 8
    assert points["allreduce 4 KiB"]["iters"] == 3
    for p in points.values():
        for setting in ("on", "off"):
            assert p[setting]["n"] == 2 and 0 < p[setting]["min"] <= p[setting]["max"]
        assert 0 < p["ratio"]["min"] <= p["ratio"]["median"] <= p["ratio"]["max"]
    assert res["check_cached_us"]["median"] > 0 and res["check_first_us"]["median"] > 0
    assert set(res["share_cached"]) == set(res["share_first"]) == set(points)
    assert res["init_time"]["n"] == 4  # one init per phase: 2 repeats x on, off


def test_checks_cli_rejects_a_bad_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "checks", "--step-iters", "0"]) != 0
    assert "--step-iters" in capsys.readouterr().err


def _request(*shapes: tuple[int, ...], dtype: str = "torch.float32") -> Request:
    return Request("w", "allreduce", tuple(TensorMeta(s, dtype) for s in shapes), op="Sum")


def test_happy_path_and_a_difference() -> None:
    req = _request((4,), (2, 3))
    copies = {r: pickle.loads(pickle.dumps(req)) for r in range(3)}
    assert mismatch("w", copies) is None  # equal, as unpickled from peers
    assert mismatch("w", dict.fromkeys(range(3), req)) is None  # one cached object
    copies[2] = _request((4,), (2, 3), dtype="torch.float64")
    problem = mismatch("w", copies)
    assert problem is not None and "(dtype differs)" in problem
    assert "ranks 0-1: allreduce(op=Sum, float32[4], float32[2, 3])" in problem
    assert "rank 2: allreduce(op=Sum, float64[4], float64[2, 3])" in problem
    err = Request("w", "allreduce", error="allreduce expects a torch.Tensor, got list")
    assert "invalid on ranks 0-1" in str(mismatch("w", dict.fromkeys(range(2), err)))


@pytest.mark.parametrize("cached", [True, False])
def test_check_cost_is_measured_per_call(cached: bool) -> None:
    samples = check_cost_us(world_size=4, repeats=3, calls=50, cached=cached)
    assert len(samples) == 3 and all(s > 0 for s in samples)
