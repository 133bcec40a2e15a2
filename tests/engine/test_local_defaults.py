"""A bare ``sync_every=H``'s outer exchange (ringtrain.engine.local_defaults) on injected link
and compute figures: no processes (issue 40 item 1)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import pytest
import torch
from _local import Tiny, _alike, _step

import ringtrain as rt
from ringtrain.config import Config
from ringtrain.engine import auto, local_defaults, local_first, local_policy
from ringtrain.testing import spawn

# A ~1.3M-parameter model, 14 ms of compute per step, local updates every 64 steps.
NUMEL = 1_300_000
COMPUTE = 0.014
H = 64
LATENCY = 0.002
SLOW = 10e6 / 8 * 0.9  # 10 Mbit/s, bytes per second
FAST = 10e9 / 8


def bare(**settings: Any) -> Config:
    """The Config of ``sync_every=H`` with ``settings`` given as DistributedOptimizer's
    arguments are (Config.replace: given, even at the default's value)."""
    return Config.from_env({}).replace(sync_every=str(H), **settings)


def test_slow_link_gets_int4_overlapped_with_a_delay_that_fits_the_wire() -> None:
    config = bare()
    assert local_defaults.wanted(config)
    out = local_defaults.choose(config, NUMEL, H, COMPUTE, LATENCY, SLOW)
    assert out is not None and (out.compression, out.overlap) == ("int4", True)
    wire = local_policy.exchange_s(NUMEL, "int4", SLOW, LATENCY)
    assert out.delay * COMPUTE >= wire > (out.delay - 1) * COMPUTE  # the fewest steps that fit
    line = local_defaults.line(H, out)
    assert f"sync_every={H} outer exchange int4, overlapped (delay {out.delay})" in line
    assert "slow" in line


def test_fast_link_keeps_fp16_in_line_as_without_the_measurement() -> None:
    config = bare()
    out = local_defaults.choose(config, NUMEL, H, COMPUTE, LATENCY / 100, FAST)
    assert out is not None
    # What the Config alone would run: the same codec, overlap and delay.
    assert (out.compression, out.overlap, out.delay) == (
        config.outer_compression,
        config.outer_overlap,
        config.outer_delay,
    )
    assert "not overlapped" in local_defaults.line(H, out)


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({"outer_compression": "fp16"}, ("fp16", True)),  # the default's value, given
        ({"outer_compression": "int8"}, ("int8", True)),
        ({"outer_overlap": False}, ("int4", False)),  # the default's value, given
    ],
)
def test_an_explicit_setting_wins_on_a_slow_link_and_is_named(
    given: dict[str, Any], want: tuple[str, bool]
) -> None:
    config = bare(**given)
    assert local_defaults.wanted(config)  # the other one is still the defaults' to choose
    out = local_defaults.choose(config, NUMEL, H, COMPUTE, LATENCY, SLOW)
    assert out is not None and (out.compression, out.overlap) == want
    assert f"as set ({next(iter(given))})" in out.why


def test_both_given_measures_nothing_and_a_variable_counts_as_given() -> None:
    assert not local_defaults.wanted(bare(outer_compression="fp16", outer_overlap=False))
    env = {"RINGTRAIN_OUTER_COMPRESSION": "fp16", "RINGTRAIN_OUTER_OVERLAP": "0"}
    assert not local_defaults.wanted(Config.from_env(env))
    assert local_defaults.wanted(Config.from_env({"RINGTRAIN_OUTER_OVERLAP": "0"}))


def test_nothing_timed_leaves_the_config_s_settings() -> None:
    assert local_defaults.choose(bare(), NUMEL, H, 0.0, LATENCY, SLOW) is None


def test_first_round_times_steps_agrees_and_logs_on_rank_0(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first round's measurement with the probe and the agreement injected: the median
    step, the probe's link, the shortest round over the ranks (the MAX of -H)."""
    clock = itertools.count(0.0, COMPUTE)  # every inner step takes COMPUTE
    monkeypatch.setattr(local_defaults.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(auto, "probe_link", lambda group, nbytes: (LATENCY, SLOW))
    agreed: list[list[float]] = []

    def slowest(group: Any, values: list[float]) -> list[float]:
        agreed.append(values)
        return [v if i != 3 else -16.0 for i, v in enumerate(values)]  # another rank: H 16

    monkeypatch.setattr(auto, "slowest", slowest)
    first = local_defaults.FirstRound(bare())
    for _ in range(H):
        first.tick()
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        out = first.settle(None, NUMEL, H, rank=0, size=2)
    assert first.settled and agreed[0][0] == pytest.approx(COMPUTE)
    assert agreed[0][3] == -H
    want = local_policy.outer_settings(NUMEL, 16, COMPUTE, SLOW, LATENCY)
    assert out == want and out.delay <= 16
    assert [r.getMessage() for r in caplog.records] == [local_defaults.line(H, want)]
    caplog.clear()
    other = local_defaults.FirstRound(bare())
    for _ in range(H):
        other.tick()
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        assert other.settle(None, NUMEL, H, rank=1, size=2) == want
    assert not caplog.records  # rank 0 alone logs


@pytest.mark.parametrize(("rate", "every"), [(SLOW, None), (FAST, 0)])
def test_auto_s_first_round_decides_on_the_same_figures(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, rate: float, every: Any
) -> None:
    """sync_every="auto"'s first round: the same measurement, then H (a slow link) or
    synchronous training (a fast one), local_first's choice on the agreed figures."""
    clock = itertools.count(0.0, COMPUTE)
    monkeypatch.setattr(local_defaults.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(auto, "probe_link", lambda group, nbytes: (LATENCY, rate))
    monkeypatch.setattr(auto, "slowest", lambda group, values: values)
    config = Config.from_env({"RINGTRAIN_SYNC_EVERY": "auto"})
    first = local_defaults.FirstRound(config, decides=True)
    for _ in range(local_first.START_H):
        first.tick()
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        out = first.settle(None, NUMEL, local_first.START_H, rank=0, size=2)
    fusion = config.fusion_threshold_bytes
    m = local_first.measurement(NUMEL, 2, fusion, COMPUTE, LATENCY, rate)
    want = local_first.decide(config, m)
    assert first.choice == want and out == want.outer
    assert (want.sync_every == 0) == (every == 0)
    assert [r.getMessage() for r in caplog.records] == [local_first.line(want)]


def _bare(sync_every: int) -> tuple[Tiny, Any]:
    """A seeded model and its optimizer with a bare ``sync_every``."""
    torch.manual_seed(0)
    model = Tiny()
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every=sync_every,
    )
    return model, opt


def _bare_rounds() -> dict[str, Any]:
    model, opt = _bare(3)
    for i in range(3 * 3):
        _step(model, opt, i)
    local = opt.local_update
    assert local is not None
    for frag in local.fragments:  # overlapped: the last round's average, applied
        if frag.pending is not None:
            local._merge(frag)
    assert local.anchor is not None
    anchor = torch.cat([a.reshape(-1) for a in local.anchor])
    # A load takes the saved choice instead of measuring again.
    again = rt.DistributedOptimizer(torch.optim.Adam(Tiny().parameters(), lr=0.01), sync_every=3)
    again.load_state_dict(opt.state_dict())
    loaded = again.local_update
    assert loaded is not None
    return {
        "chosen": (local.codec_name, local.overlap, local.delay, local.outer_reason),
        "loaded": (loaded.codec_name, loaded.overlap, loaded.delay, loaded.outer_reason),
        "alike": _alike(anchor),
    }


@pytest.mark.timeout(120)
def test_a_bare_sync_every_chooses_alike_on_every_rank() -> None:
    """Two ranks, a bare sync_every=3: whatever the loopback link measures, every rank runs
    the same choice, says why, and the anchors agree; a loaded state_dict brings the choice."""
    results = spawn.world(2).run(_bare_rounds, timeout=90)
    assert results[0]["chosen"] == results[1]["chosen"]
    assert all(r["loaded"] == r["chosen"] for r in results)
    assert all(r["alike"] for r in results)
    codec, overlap, delay, why = results[0]["chosen"]
    assert "the link is" in why and codec in why
    assert codec in ("int4", "fp16") and (delay >= 1 if overlap else True)


PROBE_S = 0.6  # a slow link's probe, as at 10 Mbit/s
STEP_S = 0.3  # each inner step of the first round: the round outlasts the probe


def _probe_beside_the_round(reads: float | None) -> dict[str, Any]:
    """A bare sync_every=4 whose probe takes PROBE_S and reads ``reads`` bytes per second
    (None: what the real probe reads on loopback): at which inner steps the probe ran (the
    round's last one holds the first outer exchange), and what that exchange cost (the shared
    test world gets the real probe back)."""
    real = auto.probe_link
    seen: dict[str, Any] = {"at": [], "step": 0}

    def probe(group: Any, nbytes: int, *rest: Any) -> tuple[float, float]:
        seen["at"].append(seen["step"])
        if reads is None:
            return real(group, nbytes, *rest)
        time.sleep(PROBE_S)
        return 1e-3, reads

    auto.probe_link = probe  # type: ignore[assignment]
    try:
        model, opt = _bare(4)
        for i in range(4):
            seen["step"] = i
            _step(model, opt, i)
            time.sleep(STEP_S)
        local = opt.local_update
        assert local is not None
        seen["outer_s"] = local.outer_seconds
        seen["why"] = local.outer_reason
    finally:
        auto.probe_link = real  # type: ignore[assignment]
    return seen


@pytest.mark.timeout(120)
def test_a_slow_link_is_probed_beside_the_first_round_s_steps() -> None:
    """The probe is queued at the round's first step on the outer exchange's worker: it runs
    while the ranks compute, and the first outer step finds a slow link's figures ready."""
    # Slow enough that the 64 KiB allreduces of the tiny model's probe take 0.2 s each.
    reads = auto.PROBE_MIN_BYTES / (2 * local_defaults.TRUSTED_PROBE_S)
    for seen in spawn.world(2).run(_probe_beside_the_round, reads, timeout=90):
        assert seen["at"] == [0], seen  # queued at the first step, not probed again
        assert seen["outer_s"] < PROBE_S - 0.2, seen  # it would hold the probe's PROBE_S
        assert "the link is" in seen["why"], seen


@pytest.mark.timeout(120)
def test_a_short_probe_beside_the_steps_is_taken_again_alone() -> None:
    """A fast link's probe takes milliseconds, which the GIL's waits behind the steps can
    double (a fast link would look slow), so the first outer step probes it again, alone."""
    for seen in spawn.world(2).run(_probe_beside_the_round, None, timeout=90):
        assert seen["at"] == [0, 3], seen  # beside the first step, then alone at the exchange
        assert "the link is" in seen["why"], seen


def test_a_probe_beside_the_steps_stands_only_when_it_is_long() -> None:
    grad = NUMEL * 4
    assert local_defaults.beside_stands(grad, SLOW)  # 0.15 s allreduces
    assert not local_defaults.beside_stands(grad, FAST)
    assert not local_defaults.beside_stands(grad, 500e6)  # loopback behind the GIL
    # The fewest bytes a probe sends: 64 KiB at 10 Mbit/s take 58 ms, too short to stand.
    assert not local_defaults.beside_stands(1024, SLOW)
