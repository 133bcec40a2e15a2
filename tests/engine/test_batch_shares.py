"""batch_shares: ranks weigh by the samples they took, so the step is the global batch's."""

from __future__ import annotations

import logging
import time
from typing import Any

import _shares as task
import pytest
import torch
import torch.nn.functional as F
from _shares import SHARES, UNIT

import ringtrain as rt
from ringtrain.config import Config
from ringtrain.engine import settings
from ringtrain.engine.auto_shares import (
    MEASURE_STEPS,
    WARMUP_STEPS,
    AutoShares,
    describe,
    shares_for,
)
from ringtrain.engine.settings import Reduction
from ringtrain.engine.weighting import Averaging, check_shares, weight_of
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World

STEPS = 4

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "sharded": {"shard_optimizer": True},
    "reduce_scatter": {"shard_optimizer": True, "reduce_scatter": True},
    "overlap": {"overlap": True},
    "passes2": {"backward_passes_per_step": 2, "average_aggregated_gradients": True},
    "predivide": {"gradient_predivide_factor": 2.0},
}
# Not exact (a 16-bit wire): held to a tolerance of its own, not the 1e-6 above.
INEXACT = {"fp16": {"compression": rt.Compression.fp16}}


def _train(variant: str) -> list[torch.Tensor]:
    r = rt.rank()
    kwargs = dict({**VARIANTS, **INEXACT}[variant])
    passes = kwargs.get("backward_passes_per_step", 1)
    model = task.model()
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        batch_shares=list(SHARES),
        **kwargs,
    )
    for step in range(STEPS):
        x, y = task.data(step)
        opt.zero_grad()
        rows = torch.arange(len(y))[task.mine(r)]
        for part in rows.chunk(passes):  # k passes over the rank's samples, each a mean
            F.cross_entropy(model(x[part]), y[part]).backward()
        opt.step()
    if variant == "overlap":
        opt.synchronize()  # the last step's updates are final now
    return [p.detach().clone() for p in model.parameters()]


def _reference() -> list[torch.Tensor]:
    model = task.model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = task.data(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # the mean over the whole global batch
        opt.step()
    return [p.detach() for p in model.parameters()]


def _sparse(distributed: bool) -> list[torch.Tensor]:
    """An embedding with sparse gradients (all-gathered, weighted before the gather), SGD."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 3, sparse=True)
    opt: Any = torch.optim.SGD(model.parameters(), lr=0.5)
    if distributed:
        opt = rt.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), batch_shares=list(SHARES)
        )
    for step in range(STEPS):
        ids = torch.randint(
            0, 10, (sum(SHARES) * UNIT,), generator=torch.Generator().manual_seed(step)
        )
        mine = ids[task.mine(rt.rank())] if distributed else ids
        opt.zero_grad()
        model(mine).square().mean().backward()
        opt.step()
    return [model.weight.detach().clone()]


def _all_variants() -> dict[str, list[list[torch.Tensor]]]:
    runs = {v: _train(v) for v in [*VARIANTS, "fp16"]}
    return {
        "again": [_train("plain")],
        "sparse": [_sparse(True)],
        **{v: [w] for v, w in runs.items()},
    }


def test_weighted_steps_equal_the_global_batch_and_repeat_bitwise(world2: World) -> None:
    expected = _reference()
    for per_rank in world2.run(_all_variants):
        sparse = per_rank.pop("sparse")[0]
        torch.testing.assert_close(sparse, _sparse(False), rtol=1e-6, atol=1e-6)
        for variant, (weights,) in per_rank.items():
            tol = 1e-2 if variant in INEXACT else 1e-6
            for got, want in zip(weights, expected):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=variant)
        for a, b in zip(per_rank["plain"][0], per_rank["again"][0]):
            assert torch.equal(a, b), "two runs with the same shares differ"


def test_weights_and_factors() -> None:
    assert weight_of(None, 0, 2) is None
    assert weight_of([2, 2, 2], 1, 3) is None  # equal shares: the plain average's bits
    assert weight_of([3, 1], 1, 2) == 0.25
    with pytest.raises(ConfigError, match="2 entries but the process set has 3"):
        weight_of([3, 1], 0, 3)
    for bad in ([0, 1], [-1, 2], "fast", [True, 1], [], [float("nan"), 1]):
        with pytest.raises(ConfigError, match="batch_shares"):
            check_shares(bad)
    # pre * post is the weight (times 1/k), wherever the division goes.
    for avg in (
        Averaging(True, 2, weight=0.75),
        Averaging(True, 2, predivide=2.0, weight=0.75),
        Averaging(True, 2, k_scale=0.5, weight=0.75),
    ):
        pre, post = avg.factors()
        assert pre * post == pytest.approx(0.75 * avg.k_scale)
        assert pre <= 1.0 or avg.predivide != 1.0  # a 16-bit wire sums weighted values
        c_pre, c_post = avg.codec_factors()
        assert c_pre * c_post == pytest.approx(0.75 * 2 * avg.k_scale)  # the codec averages
        s_pre, s_post = avg.sparse_factors()
        assert (s_pre, s_post) == (pytest.approx(0.75 * avg.k_scale), 1.0)
    # No weight: today's factors.
    assert Averaging(True, 4).factors() == (0.25, 1.0)


def test_auto_shares_follow_the_rates_and_move_only_past_the_margin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two ranks simulated in one process: rank 1 takes 3x rank 0's time per sample."""
    seconds = {0: 0.001, 1: 0.003}  # per unit of share
    autos: list[AutoShares] = []

    def agree(vector: list[float]) -> list[float]:  # what the allreduce makes of both ranks'
        assert sum(1 for v in vector if v) == 1  # each rank fills its own place
        return [1 / seconds[r] for r in range(2)]

    autos = [AutoShares(2, r, agree, clock=lambda: 0.0) for r in range(2)]

    def steps(n: int) -> list[tuple[int, ...] | None]:
        out = []
        for _ in range(n):
            for r, a in enumerate(autos):
                start = a._last_end + seconds[r] * a.shares[r]
                out.append(a.observe(start, start + 0.01))
        return out

    with caplog.at_level(logging.WARNING, logger="ringtrain"):  # shown at the default level
        decided = [s for s in steps(1 + WARMUP_STEPS + MEASURE_STEPS) if s is not None]
    assert decided == [(750, 250), (750, 250)]  # both ranks, at the same step
    said = [r.getMessage() for r in caplog.records if r.name == "ringtrain"]
    assert len(said) == 1  # rank 0 says it, once
    assert said[0].startswith("ringtrain batch_shares=auto: shares [750, 250] of each global")
    assert (
        "rank 0 75.0%, rank 1 25.0%; each rank's busy time per step at the shares in force "
        "[1, 1] (median of 5 steps): rank 0 1.0 ms, rank 1 3.0 ms;" in said[0]
    ), said[0]
    assert [a.shares for a in autos] == [(750, 250)] * 2
    seconds[1] = 0.0033  # 10% slower: within the margin, no change
    assert [s for s in steps(2 * MEASURE_STEPS) if s is not None] == []
    seconds[1] = 0.001  # as fast as rank 0 now: measured again
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        caplog.clear()
        steps(2 * MEASURE_STEPS)
    assert [r.levelno for r in caplog.records if r.name == "ringtrain"] == [logging.INFO]
    assert autos[0].shares == autos[1].shares == shares_for([1.0, 1.0])
    # A rank left with 1% of the batch, 5 ms of fixed time per step: its rate per sample is a
    # thirtieth of rank 0's, but it is the one that waits; the line says so.
    line = describe((500, 500), [990 / 0.015, 10 / 0.0051], (990, 10), per="round")
    assert "busy time per round at the shares in force [990, 10]" in line
    assert "rank 0 15.0 ms, rank 1 5.1 ms" in line


def _auto() -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    model = task.model()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        batch_shares="auto",
    )
    before = opt.batch_shares
    x, y = task.data(0)
    for _ in range(1 + WARMUP_STEPS + MEASURE_STEPS):
        if rt.rank() == 1:
            time.sleep(0.05)  # this rank computes slowly
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return before, opt.batch_shares


def test_auto_gives_the_slow_rank_less_on_every_rank(world2: World) -> None:
    (before0, after0), (before1, after1) = world2.run(_auto)
    assert before0 is None and before1 is None  # equal until measured
    assert after0 == after1 is not None
    assert after0[0] > after0[1]  # the sleeping rank gets less


def test_the_config_gives_shares_where_the_argument_does_not() -> None:
    config = Config.from_env({"RINGTRAIN_BATCH_SHARES": " 3, 1"})
    assert config.batch_shares == "3,1"
    plain = Reduction.of(None, 1.0, 1, False)
    assert settings.check(config, plain).shares == (3.0, 1.0)
    given = Reduction.of(None, 1.0, 1, False, [1, 2])
    assert settings.check(config, given).shares == (1.0, 2.0)  # the argument wins
    assert settings.check(Config.from_env({}), plain).shares is None
    with pytest.raises(ConfigError, match="RINGTRAIN_BATCH_SHARES=3,1"):
        Config.from_env({"RINGTRAIN_BATCH_SHARES": "3,fast"})
    # With local updates given shares weigh the outer average (test_local_update_shares.py);
    # measured ones are refused there.
    assert settings.check(Config.from_env({"RINGTRAIN_SYNC_EVERY": "10"}), given).shares
    with pytest.raises(ConfigError, match="op=Sum"):
        Reduction.of("Sum", 1.0, 1, False, [1, 2])


def test_auto_shares_are_refused_with_overlap() -> None:
    # Checked before any process world is needed: the argument and the variable alike.
    overlapped = Config.from_env({}).replace(overlap=True)
    auto = Reduction.of(None, 1.0, 1, False, "auto")
    with pytest.raises(ConfigError, match=r"overlap=True does not have"):
        settings.check(overlapped, auto)
    from_env = Config.from_env({"RINGTRAIN_BATCH_SHARES": "auto", "RINGTRAIN_OVERLAP": "1"})
    with pytest.raises(ConfigError, match=r"batch_shares='auto' agrees on new shares"):
        settings.check(from_env, Reduction.of(None, 1.0, 1, False))
    # Given shares do combine with overlap, and "auto" without it is accepted.
    assert settings.check(overlapped, Reduction.of(None, 1.0, 1, False, [3, 1])).shares
    assert settings.check(Config.from_env({}), auto).shares == "auto"
