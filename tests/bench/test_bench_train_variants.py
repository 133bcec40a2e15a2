"""``ringtrain bench train`` comparing compression methods in one run (``ringtrain:NAME`` variants):
a smoke test on 2 spawned ranks, structure only, never timings; and the variant names it accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.bench.train import TrainParams, engine_options, variant_compression
from ringtrain.compression.policy import PREFERENCE
from ringtrain.config import Config
from ringtrain.errors import ConfigError


def test_variant_names() -> None:
    assert variant_compression("ringtrain:topk", "fp16") == "topk"
    assert variant_compression("ringtrain", "fp16") == "fp16"
    assert variant_compression("ddp", "fp16") == "fp16"
    TrainParams(variants=("ringtrain", "ringtrain:powersgd", "ddp", "nocomm"))
    TrainParams(variants=("ringtrain", "ringtrain@fusion=25@cycle=1000", "ringtrain:fp16@cycle=5"))
    assert engine_options("ringtrain@fusion=0") == {"fusion_threshold_bytes": 0}
    assert variant_compression("ringtrain:fp16@fusion=8", "none") == "fp16"
    assert engine_options("ringtrain:fp16@fusion=8@cycle=0.5") == {
        "fusion_threshold_bytes": 8 << 20,
        "cycle_time_ms": 0.5,
    }
    assert engine_options("ringtrain@repro=0@link=slow") == {
        "reproducible": False,
        "link_class": "slow",
    }
    assert engine_options("ringtrain@shard=1") == {"shard_optimizer": True}
    TrainParams(variants=("ringtrain", "ringtrain@shard=1"), optimizer="adam")
    assert engine_options("ringtrain:fp16@overlap=1") == {"overlap": True}
    for bad in (
        ("ringtrain@overlap=yes",),
        ("ddp:topk",),
        ("ringtrain:",),
        ("ringtrain", "ringtrain"),
        ("nocomm:fp16",),
        ("ddp@fusion=25",),
        ("ringtrain@buckets=3",),
        ("ringtrain@fusion=big",),
        ("ringtrain@fusion=-1",),
        ("ringtrain@cycle=inf",),
        ("ringtrain@cycle=0",),
        ("ringtrain@link=medium",),
        ("ringtrain@repro=no",),
        ("ringtrain@shard=yes",),
    ):
        with pytest.raises(ConfigError, match="HINT"):
            TrainParams(variants=bad)


def test_unknown_compression_fails_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "train", "--variants", "ringtrain:zip,nocomm"]) == 2
    assert "zip" in capsys.readouterr().err


def test_methods_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "train.json"
    variants = "ringtrain,ringtrain:fp16,ringtrain:powersgd,ringtrain:topk,ringtrain:auto,nocomm"
    variants += ",ringtrain@fusion=1@cycle=1000"
    argv = ["bench", "train", "-np", "2", "--model", "mlp-1m", "--steps", "2", "--warmup", "1"]
    argv += ["--block", "1", "--batch-size", "8", "--variants", variants]
    argv += ["--json", str(out_json), "--timeout", "240"]
    assert cli.main(argv) == 0

    printed = capsys.readouterr().out
    assert "ringtrain:topk" in printed and "warm-up steps until steady" in printed
    res = json.loads(out_json.read_text())["result"]
    got = {v["variant"]: v for v in res["variants"]}
    assert list(got) == variants.split(",")
    for v in got.values():
        assert v["step_time"]["n"] == 2 and v["vs_nocomm"] > 0
    # PowerSGD's uncompressed start steps are warm-up, not timed steps.
    assert got["ringtrain:powersgd"]["warmup_steps"] > Config().powersgd_start_step
    assert got["ringtrain:topk"]["warmup_steps"] == 1
    # auto measured, decided and settled before timing began.
    assert got["ringtrain:auto"]["chosen"] in PREFERENCE
    assert got["ringtrain:auto"]["warmup_steps"] > 1


@pytest.mark.timeout(300)
def test_overlap_variant_with_adam(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "train.json"
    variants = "ringtrain,ringtrain@overlap=1,ddp"
    argv = ["bench", "train", "-np", "2", "--model", "mlp-1m", "--steps", "4", "--warmup", "1"]
    argv += ["--block", "2", "--batch-size", "8", "--optimizer", "adam", "--variants", variants]
    argv += ["--json", str(out_json), "--timeout", "240"]
    assert cli.main(argv) == 0
    assert "optimizer adam" in capsys.readouterr().out
    res = json.loads(out_json.read_text())["result"]
    assert res["params"]["optimizer"] == "adam"
    got = {v["variant"]: v for v in res["variants"]}
    assert list(got) == variants.split(",")
    assert got["ringtrain@overlap=1"]["step_time"]["n"] == 4
    assert got["ringtrain@overlap=1"]["vs_ddp"] > 0
    # CPU per step, every thread of both ranks: at least the compute, which both ranks do.
    for v in got.values():
        assert v["cpu_per_step"] > 0
    assert got["ddp"]["cpu_vs_ddp"] == 1.0 and got["ringtrain"]["cpu_vs_ddp"] > 0
