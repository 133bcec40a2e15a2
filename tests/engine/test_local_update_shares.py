"""Local updates on ranks of unequal speed: the outer average weighs each rank by its samples.

Two ways to give a faster rank more work (issue 41 item 4): ``batch_shares=[3, 1]`` (equal inner
steps on 6 and 2 samples of each global batch) and ``sync_every=[4, 2]`` (equal batches, rank 0
takes twice the inner steps a round). After a few rounds the anchor equals that of one process
that runs both ranks' inner steps and steps the outer optimizer with the mean of their changes
weighted by the samples each took."""

from __future__ import annotations

import time
from typing import Any

import _shares as task
import pytest
import torch
import torch.nn.functional as F
from _shares import SHARES

import ringtrain as rt
from ringtrain.config import Config
from ringtrain.engine import local_settings, settings
from ringtrain.engine.local_update import nesterov
from ringtrain.engine.settings import Reduction
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World

H = 3  # sync_every
ROUNDS = 3


def _inner_step(model: torch.nn.Module, opt: Any, step: int, r: int) -> None:
    x, y = task.data(step)
    opt.zero_grad()
    F.cross_entropy(model(x[task.mine(r)]), y[task.mine(r)]).backward()
    opt.step()


def _local(model: torch.nn.Module, shares: list[int] | str | None, overlap: bool = False) -> Any:
    """Adam inside local updates every H steps, the outer exchange in float32 (an exact wire)
    and its overlap given (the link is then not measured: engine/local_defaults)."""
    return rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every=H,
        outer_compression="none",
        outer_overlap=overlap,
        batch_shares=shares,
    )


def _train(shares: list[int] | None) -> list[torch.Tensor]:
    """This rank's anchor after ROUNDS rounds."""
    model = task.model()
    opt = _local(model, shares)
    for step in range(H * ROUNDS):
        _inner_step(model, opt, step, rt.rank())
    local = opt.local_update
    assert local is not None and local.inner_steps == 0 and local.anchor is not None
    return [a.clone() for a in local.anchor]


def _runs() -> dict[str, list[torch.Tensor]]:
    return {
        "shares": _train(list(SHARES)),
        "again": _train(list(SHARES)),
        "equal": _train([2, 2]),
        "plain": _train(None),
    }


def _outer_step(
    anchor: list[torch.Tensor],
    ranks: list[torch.nn.Module],
    weights: list[float],
    outer: torch.optim.Optimizer,
) -> None:
    """One process's outer step: the anchor moves by the weighted average of the ranks'
    changes, and every rank starts the next round from it."""
    with torch.no_grad():
        for i, a in enumerate(anchor):
            own = [list(m.parameters())[i] for m in ranks]
            a.grad = sum(w * (a - p) for w, p in zip(weights, own))  # type: ignore[assignment]
        outer.step()
        for m in ranks:
            for p, a in zip(m.parameters(), anchor):
                p.copy_(a)


def _reference() -> list[torch.Tensor]:
    """Both ranks' inner steps in one process; each round the anchor takes the outer step
    (DiLoCo's Nesterov) with the share-weighted mean of the ranks' changes."""
    ranks = [task.model() for _ in SHARES]
    inner = [torch.optim.Adam(m.parameters(), lr=0.01) for m in ranks]
    anchor = list(task.model().parameters())
    outer = nesterov(anchor)
    weights = [s / sum(SHARES) for s in SHARES]
    for step in range(H * ROUNDS):
        for r, (m, opt) in enumerate(zip(ranks, inner)):
            _inner_step(m, opt, step, r)
        if (step + 1) % H == 0:
            _outer_step(anchor, ranks, weights, outer)
    return [a.detach() for a in anchor]


def test_the_outer_average_weighs_ranks_by_share_and_repeats_bitwise(world2: World) -> None:
    expected = _reference()
    per_rank = world2.run(_runs)
    for runs in per_rank:
        for got, want in zip(runs["shares"], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(runs["shares"], runs["again"]):
            assert torch.equal(a, b), "two runs with the same shares differ"
        for a, b in zip(runs["equal"], runs["plain"]):
            assert torch.equal(a, b), "equal shares must keep the plain mean's bits"
        # The weighting is seen: the plain mean's anchor is elsewhere.
        assert any(not torch.allclose(a, b) for a, b in zip(runs["shares"], runs["plain"]))
    for a, b in zip(per_rank[0]["shares"], per_rank[1]["shares"]):
        assert torch.equal(a, b), "the ranks' anchors differ"


STEPS = (4, 2)  # sync_every per rank: rank 0, the faster, takes twice the inner steps a round


def _own_batch(r: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * r + i)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def _own_step(model: torch.nn.Module, opt: Any, r: int, i: int) -> None:
    x, y = _own_batch(r, i)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


# The exact run twice, then the overlapped exchange in two fragments on the 4-bit wire (each
# rank exchanges fragment f at its own step (f + 1) * H_r // 2, in the same order).
RUNS: list[dict[str, Any]] = [
    {"outer_compression": "none", "outer_overlap": False},  # given: nothing measured
    {"outer_compression": "none", "outer_overlap": False},
    {"outer_compression": "int4", "outer_overlap": True, "outer_fragments": 2},
]


def _train_steps() -> dict[str, Any]:
    """This rank's anchor after ROUNDS rounds of its own number of inner steps, per run."""
    anchors = []
    for run in RUNS:
        model = task.model()
        opt = rt.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            sync_every=list(STEPS),
            **run,
        )
        for i in range(STEPS[rt.rank()] * ROUNDS):
            _own_step(model, opt, rt.rank(), i)
        local = opt.local_update
        assert local is not None and local.inner_steps == 0 and local.anchor is not None
        anchors.append([a.clone() for a in local.anchor])
    return {"anchors": anchors, "round": local.sync_every, "rounds": local.outer_steps}


def _reference_steps() -> list[torch.Tensor]:
    ranks = [task.model() for _ in STEPS]
    inner = [torch.optim.Adam(m.parameters(), lr=0.01) for m in ranks]
    anchor = list(task.model().parameters())
    outer = nesterov(anchor)
    weights = [h / sum(STEPS) for h in STEPS]  # equal batches: samples are steps
    for round_ in range(ROUNDS):
        for r, (m, opt) in enumerate(zip(ranks, inner)):
            for i in range(STEPS[r] * round_, STEPS[r] * (round_ + 1)):
                _own_step(m, opt, r, i)
        _outer_step(anchor, ranks, weights, outer)
    return [a.detach() for a in anchor]


def test_a_faster_rank_takes_more_inner_steps_and_weighs_by_them(world2: World) -> None:
    expected = _reference_steps()
    per_rank = world2.run(_train_steps)
    for r, got in enumerate(per_rank):
        assert (got["round"], got["rounds"]) == (STEPS[r], ROUNDS)
        first, again, _ = got["anchors"]
        for a, want in zip(first, expected):
            torch.testing.assert_close(a, want, rtol=1e-6, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), "two runs differ"
    for run in range(len(RUNS)):
        for a, b in zip(per_rank[0]["anchors"][run], per_rank[1]["anchors"][run]):
            assert torch.equal(a, b), f"the ranks' anchors differ ({RUNS[run]})"


def test_per_rank_rounds_are_parsed_checked_and_weighed() -> None:
    assert local_settings.parse_sync_every("48, 16") == (48, 16)
    assert local_settings.parse_sync_every([48, 16]) == (48, 16)
    assert Config.from_env({"RINGTRAIN_SYNC_EVERY": "48, 16"}).sync_every == "48,16"
    assert settings.resolve(Config.from_env({}), sync_every=[4, 2]).sync_every == "4,2"
    for bad in ([4, 0], [4, True], "4,x", [4, [2]]):
        with pytest.raises(ConfigError, match="one number >= 1 per rank"):
            local_settings.parse_sync_every(bad)
    with pytest.raises(ConfigError, match="must be >= 1"):
        Config.from_env({"RINGTRAIN_SYNC_EVERY": "4,0"})
    with pytest.raises(ConfigError, match=r"2 entries .* 3 ranks"):
        local_settings.round_steps((4, 2), 0, 3)
    # Samples a round: inner steps times the share of each global batch.
    assert local_settings.outer_weight((4, 2), None, 1, 2) == pytest.approx(1 / 3)
    assert local_settings.outer_weight((4, 2), (1.0, 3.0), 0, 2) == pytest.approx(0.4)
    assert local_settings.outer_weight(8, (3.0, 1.0), 0, 2) == 0.75
    assert local_settings.outer_weight((2, 2), None, 0, 2) is None  # equal: the plain mean
    assert local_settings.outer_weight((2, 6), (3.0, 1.0), 0, 2) is None
    # The shortest round bounds the delay and the fragments.
    with pytest.raises(ConfigError, match="outer_fragments=3 is more than the round's 2"):
        local_settings.check(Config.from_env({}, sync_every="4,2", outer_fragments=3))


def test_measured_shares_take_a_number_of_steps_and_refuse_other_rounds() -> None:
    fixed = Reduction.of(None, 1.0, 1, False, [3, 1])
    measured = Reduction.of(None, 1.0, 1, False, "auto")
    config = Config.from_env({"RINGTRAIN_SYNC_EVERY": "10"})
    assert settings.check(config, fixed).shares == (3.0, 1.0)
    assert settings.check(config, measured).shares == "auto"  # measured a round at a time
    for rounds in ("auto", "4,2"):
        config = Config.from_env({"RINGTRAIN_SYNC_EVERY": rounds})
        with pytest.raises(ConfigError, match="give the shares"):
            settings.check(config, measured)


# Seconds a whole global batch takes on each rank: rank 1 runs at a fifth of rank 0's speed.
# Each rank sleeps its share of that a step, so its time follows the shares in force as a slower
# device's would, and dwarfs the model's own compute even on a loaded machine. (A fixed 4 ms on
# rank 1 alone left 1.4x between the ranks on a busy CI machine, where a step's compute had grown
# to about 10 ms.)
BATCH_S = (0.02, 0.1)


def _measured(overlap: bool) -> dict[str, Any]:
    """batch_shares="auto" with local updates, rank 1 slowed: the shares after 6 rounds, the
    outer weight in force, the anchors (the same on every rank after an outer step)."""
    model = task.model()
    opt = _local(model, "auto", overlap)
    for step in range(H * 6 + 1):  # the last step sets the weight from the shares in force
        shares = opt.batch_shares or (1, 1)
        time.sleep(BATCH_S[rt.rank()] * shares[rt.rank()] / sum(shares))
        _inner_step(model, opt, step, rt.rank())
    local = opt.local_update
    assert local is not None
    if overlap:
        local.outer_step()  # apply the last average now: every rank then holds one anchor
        for frag in local.fragments:
            if frag.pending is not None:
                local._merge(frag)
    assert local.anchor is not None
    return {"shares": opt.batch_shares, "weight": local.weight, "anchor": local.anchor}


def _both() -> dict[str, Any]:
    return {"inline": _measured(False), "overlapped": _measured(True)}


def test_measured_shares_follow_each_rank_s_rate_a_round_at_a_time(world2: World) -> None:
    per_rank = world2.run(_both)
    for run in ("inline", "overlapped"):
        shares = [r[run]["shares"] for r in per_rank]
        assert shares[0] == shares[1] and shares[0] is not None, shares  # agreed
        fast, slow = shares[0]
        # The faster rank takes more of each global batch: near 5x quiet, 3.2x at the least
        # beside 4 CPU hogs on 2 cores.
        assert fast > 2 * slow, shares
        # The outer average weighs each rank by its share (equal inner steps a round).
        for r, got in enumerate(per_rank):
            assert got[run]["weight"] == pytest.approx(shares[0][r] / sum(shares[0]))
        for a, b in zip(per_rank[0][run]["anchor"], per_rank[1][run]["anchor"]):
            assert torch.equal(a, b), f"the ranks' anchors differ ({run})"


def _first_choice(overlap: bool = True, logged: bool = False) -> Any:
    """The shares of batch_shares="auto"'s first decision (at the end of round 3: round 1 starts
    the clock, round 2 is let pass), rank 1 five times slower; ``logged``: a collective between
    two steps of every round, as a script's loss logging (it waits for the slow rank)."""
    model = task.model()
    opt = _local(model, "auto", overlap=overlap)
    for step in range(H * 3 + 1):
        shares = opt.batch_shares or (1, 1)
        time.sleep(BATCH_S[rt.rank()] * shares[rt.rank()] / sum(shares))
        _inner_step(model, opt, step, rt.rank())
        if logged and step % H == 1:
            rt.allreduce(torch.ones(1), name=f"loss.{step}")
    return opt.batch_shares


def _first_choice_logged() -> Any:
    return _first_choice(overlap=False, logged=True)


def test_the_first_measured_round_excludes_the_wait_for_the_exchange_in_flight(
    world2: World,
) -> None:
    # The round let pass left its overlapped exchange in flight; the fast rank's next merge
    # waited for the slow rank's round in it, counted as its own work: both ranks measured
    # alike (rates 3% apart) and the first decision kept equal shares.
    per_rank = world2.run(_first_choice)
    assert per_rank[0] == per_rank[1], per_rank  # agreed
    fast, slow = per_rank[0] or (1, 1)  # None: equal shares kept
    assert fast > 2 * slow, per_rank


def test_a_collective_between_steps_is_not_counted_as_a_rank_s_work(world2: World) -> None:
    # The fast rank waited for the slow one in the script's collective; its whole round was
    # counted as its work, so both ranks measured the slow rank's pace (in line too).
    per_rank = world2.run(_first_choice_logged)
    assert per_rank[0] == per_rank[1], per_rank
    fast, slow = per_rank[0] or (1, 1)
    assert fast > 2 * slow, per_rank
