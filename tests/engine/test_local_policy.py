"""Local updates' policy (ringtrain.engine.local_policy) on injected link and compute figures:
no processes, no clock (issue 40 items 1 and 2)."""

from __future__ import annotations

import pytest

from ringtrain.engine import local_policy as lp

# A ~1.3M-parameter model, 14 ms of compute per step, two ranks.
NUMEL = 1_300_000
COMPUTE = 0.014
SLOW = 10e6 / 8 * 0.9  # 10 Mbit/s, bytes per second
FAST = 10e9 / 8


def test_slow_link_defaults_to_int4_overlapped_with_a_fitting_delay() -> None:
    out = lp.outer_settings(NUMEL, 64, COMPUTE, SLOW)
    assert (out.compression, out.overlap) == ("int4", True)
    wire = lp.exchange_s(NUMEL, "int4", SLOW, 0.0)
    # The delay's inner steps cover the wire time, and one step fewer would not.
    assert out.delay * COMPUTE >= wire > (out.delay - 1) * COMPUTE
    assert "slow" in out.why and "int4" in out.why


def test_fast_link_keeps_the_16_bit_exchange_in_line() -> None:
    out = lp.outer_settings(NUMEL, 64, COMPUTE, FAST)
    assert (out.compression, out.overlap, out.delay) == ("fp16", False, 0)


def test_explicit_settings_win_and_are_named() -> None:
    out = lp.outer_settings(NUMEL, 64, COMPUTE, SLOW, compression="fp16", overlap=False)
    assert (out.compression, out.overlap) == ("fp16", False)
    assert "as set (outer_compression, outer_overlap)" in out.why
    out = lp.outer_settings(NUMEL, 64, COMPUTE, SLOW, compression="int8")
    assert (out.compression, out.overlap) == ("int8", True)


def test_steps_factor_grows_with_h() -> None:
    factors = [lp.steps_factor(h) for h in lp.SYNC_EVERY_CHOICES]
    assert factors == sorted(factors) and factors[-1] > factors[0]
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        lp.steps_factor(0)


def test_auto_weighs_steps_and_names_h_codec_overlap_and_prediction() -> None:
    choice = lp.choose_local(NUMEL, 2, COMPUTE, SLOW)
    # Every other H is predicted no faster to the target.
    for h in lp.SYNC_EVERY_CHOICES:
        other = lp.choose_local(NUMEL, 2, COMPUTE, SLOW, choices=(h,))
        assert other.predicted_time_per_step >= choice.predicted_time_per_step
    # Not the largest H: its cost in steps outweighs the exchange it saves.
    assert choice.sync_every < lp.SYNC_EVERY_CHOICES[-1]
    assert choice.predicted_time_per_step < 1.0
    for word in (f"every {choice.sync_every} steps", "int4", "overlapped", "time to target"):
        assert word in choice.why


def test_auto_honours_explicit_outer_settings_in_its_prediction() -> None:
    default = lp.choose_local(NUMEL, 2, COMPUTE, SLOW)
    forced = lp.choose_local(NUMEL, 2, COMPUTE, SLOW, compression="fp16", overlap=False)
    assert (forced.outer.compression, forced.outer.overlap) == ("fp16", False)
    # The wider, exposed exchange is predicted slower and pushes H up.
    assert forced.predicted_time_per_step > default.predicted_time_per_step
    assert forced.sync_every >= default.sync_every
    expected = lp.step_time_s(forced.sync_every, COMPUTE, forced.outer, NUMEL, SLOW, 0.0)
    assert forced.predicted_time_per_step == pytest.approx(
        expected * lp.steps_factor(forced.sync_every) / (2 * COMPUTE)
    )


def test_bad_input_is_refused_with_what_was_wrong() -> None:
    with pytest.raises(ValueError, match="world_size >= 2"):
        lp.choose_local(NUMEL, 1, COMPUTE, SLOW)
    with pytest.raises(ValueError, match="outer codec must be one of"):
        lp.exchange_s(NUMEL, "int3", SLOW, 0.0)
