"""bench mixed-speed: structure and sanity on tiny settings, never timings."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from ringtrain.bench import command, runner
from ringtrain.bench.mixed_speed import MixedSpeedParams, MixedSpeedResult, format_mixed_speed
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.configure(parser)
    return parser.parse_args(["mixed-speed", *argv])


def test_flags_become_params_and_bad_values_are_explained() -> None:
    p = runner._params(
        _args("-np", "3", "--slow-rank", "2", "--slow-by", "sleep", "--slow-factor", "3")
    )
    assert p == MixedSpeedParams(slow_rank=2, slow_by="sleep", factor=3.0)
    local = runner._params(_args("--slow-by", "sleep", "--sync-every", "8"))
    assert local == MixedSpeedParams(slow_by="sleep", sync_every=8)
    with pytest.raises(ConfigError, match="--sync-every >= 0"):
        runner._params(_args("--sync-every", "-1"))
    with pytest.raises(ConfigError, match="--slow-factor must be above 1"):
        runner._params(_args("--slow-factor", "1"))
    with pytest.raises(ConfigError, match="draws no plot"):
        runner._params(_args("--plot", "x.png"))
    with pytest.raises(ConfigError, match="--slow-rank 2 is not a rank of this job of 2"):
        runner._params(_args("--slow-rank", "2"))  # -np's default: 2 ranks
    with pytest.raises(ConfigError, match="--slow-rank 3 is not a rank of this job of 3"):
        MixedSpeedParams(slow_rank=3).check(3)


def test_the_table_puts_equal_auto_and_the_sum_of_alone_side_by_side() -> None:
    res = MixedSpeedResult(
        MixedSpeedParams(slow_by="sleep"), 2, [100.0, 50.0], 100.0, 140.0, [667.0, 333.0], {}
    )
    text = format_mixed_speed(res)
    assert "rank 1 sleeping to 1/2" in text
    assert "auto, shares 67%, 33%" in text and "1.40x equal, 0.93x the sum" in text
    assert "0.67x the sum" in text  # equal shares


def _run() -> Any:
    from ringtrain.bench import ranks
    from ringtrain.bench.mixed_speed import bench_mixed_speed

    p = MixedSpeedParams(slow_by="sleep", factor=3.0, global_batch=64, steps=2, width=8)
    return ranks.run(bench_mixed_speed, p, np=None, threads=None, settings={}, timeout_s=60)


def test_runs_on_the_job_s_ranks(world2: World) -> None:
    res = world2.run(_run, init=False, timeout=60)[0]
    assert res.world_size == 2 and len(res.alone) == 2
    assert res.equal > 0 and res.auto > 0 and min(res.alone) > 0
    assert len(res.shares) == 2 and all(s > 0 for s in res.shares)
