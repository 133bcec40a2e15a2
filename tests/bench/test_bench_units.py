"""The benchmarks' pure parts: presets' sizes, size parsing, statistics and tables."""

from __future__ import annotations

import os

import pytest
import torch

from ringtrain.bench import ranks
from ringtrain.bench.models import PRESETS, count_parameters
from ringtrain.bench.report import table
from ringtrain.bench.stats import Summary, bus_bandwidth
from ringtrain.bench.train import TrainParams
from ringtrain.bench.units import fmt_bytes, parse_bytes, parse_sizes
from ringtrain.errors import ConfigError


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_size_matches_its_name(name: str) -> None:
    preset = PRESETS[name]
    with torch.device("meta"):  # count without allocating 100M parameters
        model = preset.build()
    n = count_parameters(model)
    assert abs(n - preset.nominal_params) <= 0.2 * preset.nominal_params, (name, n)
    # The name states the size: mlp-10m ~ 10M, transformer-25m ~ 25M; cnn-small is ~1M.
    if name[-1] == "m" and name.split("-")[-1][:-1].isdigit():
        assert preset.nominal_params == int(name.split("-")[-1][:-1]) * 1_000_000


@pytest.mark.parametrize("name", ["mlp-1m", "cnn-small"])
def test_preset_batch_trains(name: str) -> None:
    preset = PRESETS[name]
    model = preset.build()
    x, y = preset.make_batch(3, torch.Generator().manual_seed(0))
    loss = preset.loss(model(x), y)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


def test_transformer_batch_shapes() -> None:
    preset = PRESETS["transformer-25m"]
    x, y = preset.make_batch(2, torch.Generator().manual_seed(0))
    assert x.shape == y.shape and x.shape[0] == 2
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets


def test_parse_sizes() -> None:
    assert parse_bytes("64K") == 65536
    assert parse_bytes("4MiB") == 4 << 20
    assert parse_bytes("1000") == 1000
    assert parse_sizes("4K,1M") == (4096, 1 << 20)
    assert parse_sizes("4K..64K") == (4096, 16384, 65536)
    assert parse_sizes("1K..8K:2") == (1024, 2048, 4096, 8192)
    for bad in ("4X", "64K..4K", "1K..8K:1", ""):
        with pytest.raises(ConfigError):
            parse_sizes(bad)


def test_summary_and_bus_bandwidth() -> None:
    s = Summary.of([3.0, 1.0, 2.0, 10.0, 4.0])
    assert (s.median, s.min, s.max, s.n) == (3.0, 1.0, 10.0, 5)
    assert s.q1 == 2.0 and s.q3 == 4.0
    assert s.spread == pytest.approx(2.0 / 3.0)
    assert Summary.of([5.0]).q1 == 5.0
    # 2 ranks: every byte crosses the link once; n ranks: 2(n-1)/n times.
    assert bus_bandwidth(1000, 0.5, 2) == pytest.approx(2000.0)
    assert bus_bandwidth(1000, 1.0, 4) == pytest.approx(1500.0)
    assert bus_bandwidth(1000, 1.0, 1) == 0.0


def test_train_params_validation() -> None:
    with pytest.raises(ConfigError, match="HINT"):
        TrainParams(variants=("ddp", "fsdp"))
    with pytest.raises(ConfigError):
        TrainParams(steps=0)


def test_table_formats() -> None:
    rows = [["a", "1"], ["bbb", "22"]]
    plain = table(["x", "y"], rows).splitlines()
    assert len(plain) == 4 and len({len(line) for line in plain}) == 1
    md = table(["x", "y"], rows, markdown=True).splitlines()
    assert md[0] == "| x | y |" and md[1] == "|---|---|" and md[3] == "| bbb | 22 |"
    assert fmt_bytes(65536) == "64 KiB" and fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(10) == "10 B"


def test_spawned_ranks_that_share_cores_say_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """More threads than cores: the run says its absolute times are the scheduler's too."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    ranks._say_if_oversubscribed(2, 1)
    assert capsys.readouterr().err == ""
    ranks._say_if_oversubscribed(8, 1)
    assert "8 ranks x 1 threads on 2 cores: they share cores" in capsys.readouterr().err
