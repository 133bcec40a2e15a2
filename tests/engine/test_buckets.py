"""Bucket planning as pure functions: thresholds, dtypes, readiness gaps, the agreed order."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from ringtrain.config import Config
from ringtrain.engine.buckets import (
    BUCKET_WIRE_S,
    MIN_TIMED_BUCKET_BYTES,
    NOT_SEEN,
    Observation,
    ParamSpec,
    agree,
    borderline,
    link_class,
    make_plan,
    timed_floor,
)
from ringtrain.engine.planner import Planner
from ringtrain.errors import ConfigError


def _specs(sizes: list[int], dtype: str = "torch.float32") -> list[ParamSpec]:
    return [ParamSpec(i, f"p{i}", (n,), dtype, "cpu", 4) for i, n in enumerate(sizes)]


def _obs(position: list[int], n: int, **kw: object) -> Observation:
    ready = kw.get("ready", [max(p, 0) * 10 for p in position])
    return Observation(
        tuple(position),
        tuple(ready),  # type: ignore[arg-type]
        tuple(kw.get("sparse", [False] * n)),  # type: ignore[arg-type]
        tuple(kw.get("trainable", [True] * n)),  # type: ignore[arg-type]
        tuple(kw.get("numel", [10] * n)),  # type: ignore[arg-type]
    )


def test_threshold_cuts_buckets_and_big_tensors_join_a_small_one() -> None:
    specs = _specs([10, 10, 10, 100, 10])  # 40 bytes each, one 400-byte tensor
    plan = make_plan(specs, [0, 1, 2, 3, 4], [], [True] * 5, threshold_bytes=80)
    # (2,) is below the threshold, so the big tensor joins it rather than leave it alone.
    assert [b.params for b in plan.buckets] == [(0, 1), (2, 3), (4,)]
    assert plan.buckets[1].offsets == (0, 10) and plan.buckets[1].numel == 110
    assert plan.bucket_of == {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    assert [b.key for b in plan.buckets] == ["bucket0", "bucket1", "bucket2"]
    big = make_plan(specs, [0, 1, 3, 2], [], [True] * 5, threshold_bytes=80)
    assert [b.params for b in big.buckets] == [(0, 1), (3,), (2,)]


def test_zero_threshold_sends_every_tensor_alone() -> None:
    plan = make_plan(_specs([3, 3, 3]), [2, 1, 0], [], [True] * 3, threshold_bytes=0)
    assert [b.params for b in plan.buckets] == [(2,), (1,), (0,)]


def test_dtype_change_closes_a_bucket() -> None:
    specs = [*_specs([4, 4]), ParamSpec(2, "h", (4,), "torch.float16", "cpu", 2)]
    plan = make_plan(specs, [0, 1, 2], [], [True] * 3, threshold_bytes=1 << 20)
    assert [b.params for b in plan.buckets] == [(0, 1), (2,)]
    assert plan.buckets[1].dtype == "torch.float16" and plan.buckets[1].nbytes == 8


def test_readiness_gap_closes_a_bucket_once_it_is_big_enough() -> None:
    n = MIN_TIMED_BUCKET_BYTES // 4
    specs = _specs([n, 10, 10, 10])
    ready = {0: 0, 1: 100, 2: 5_000, 3: 5_100}
    plan = make_plan(
        specs, [0, 1, 2, 3], [], [True] * 4, threshold_bytes=1 << 30, cycle_us=1000, ready_us=ready
    )
    assert [b.params for b in plan.buckets] == [(0, 1), (2, 3)]
    # A small bucket is never cut for time: one Gloo round costs more than waiting.
    small = make_plan(
        _specs([10, 10, 10, 10]),
        [0, 1, 2, 3],
        [],
        [True] * 4,
        threshold_bytes=1 << 30,
        cycle_us=1000,
        ready_us=ready,
    )
    assert len(small.buckets) == 1


def test_the_measured_rate_sets_how_big_a_bucket_a_gap_may_close() -> None:
    mib = 1 << 20
    assert timed_floor(0.0, 64 * mib) == MIN_TIMED_BUCKET_BYTES  # not measured yet
    assert timed_floor(12.5e6, 64 * mib) == MIN_TIMED_BUCKET_BYTES  # 100 Mbit/s: 375 KB
    assert timed_floor(125e6, 64 * mib) == int(125e6 * BUCKET_WIRE_S)  # 1 Gbit/s: 3.75 MB
    assert timed_floor(1e9, 64 * mib) == int(1e9 * BUCKET_WIRE_S)  # loopback: 30 MB
    assert timed_floor(1e12, 64 * mib) == 64 * mib  # never above the fusion threshold
    n = MIN_TIMED_BUCKET_BYTES // 4
    specs = _specs([n] * 6)
    ready = {i: 5_000 * i for i in range(6)}  # every gradient after a gap
    cut = functools.partial(
        make_plan, specs, list(range(6)), [], [True] * 6, threshold_bytes=1 << 30, cycle_us=1000
    )
    assert len(cut(ready_us=ready).buckets) == 6
    assert [b.params for b in cut(ready_us=ready, min_timed_bytes=3 * n * 4).buckets] == [
        (0, 1, 2),
        (3, 4, 5),
    ]


def test_auto_order_follows_rank0_then_others_then_reverse_registration() -> None:
    specs = _specs([10] * 5)
    rank0 = _obs([1, 0, NOT_SEEN, NOT_SEEN, 2], 5)
    rank1 = _obs([0, 1, NOT_SEEN, 2, 3], 5)
    plan = agree(specs, [rank0, rank1], threshold_bytes=0, cycle_time_ms=1.0)
    assert [b.params[0] for b in plan.buckets] == [1, 0, 4, 3, 2]
    again = agree(specs, [rank0, rank1], threshold_bytes=0, cycle_time_ms=1.0)
    assert again.digest == plan.digest


def test_fixed_orders_and_sparse_and_frozen_parameters() -> None:
    specs = _specs([10] * 4)
    obs = _obs([0, 1, 2, NOT_SEEN], 4, sparse=[False, True, False, False], trainable=[1, 1, 1, 0])
    rev = agree(specs, [obs, obs], threshold_bytes=0, cycle_time_ms=1.0, order="reverse")
    assert [b.params for b in rev.buckets] == [(2,), (0,)]
    assert rev.sparse == (1,)
    reg = agree(specs, [obs, obs], threshold_bytes=0, cycle_time_ms=1.0, order="registration")
    assert [b.params for b in reg.buckets] == [(0,), (2,)]
    assert reg.trainable == (True, True, True, False)
    # A parameter sparse on any rank goes the sparse way on every rank.
    other = _obs([0, 1, 2, NOT_SEEN], 4, sparse=[True, False, False, False], trainable=[1, 1, 1, 0])
    assert agree(specs, [obs, other], threshold_bytes=0, cycle_time_ms=1.0).sparse == (0, 1)


def test_ranks_that_disagree_on_the_model_fail_with_a_hint() -> None:
    specs = _specs([10, 10])
    a = _obs([0, 1], 2)
    with pytest.raises(ConfigError, match=r"\('p1'\) has 10 elements on rank 0 but 7 on rank 1"):
        agree(specs, [a, _obs([0, 1], 2, numel=[10, 7])], threshold_bytes=0, cycle_time_ms=1)
    with pytest.raises(
        ConfigError, match=r"\(.p1.\) has requires_grad=True on rank 0 but False on rank 2"
    ):
        agree(
            specs,
            [a, a, _obs([0, 1], 2, trainable=[True, False])],
            threshold_bytes=0,
            cycle_time_ms=1,
        )
    with pytest.raises(ConfigError, match="bucket_order"):
        agree(specs, [a], threshold_bytes=0, cycle_time_ms=1, order="random")


def test_observation_round_trips_through_integers() -> None:
    o = _obs([2, NOT_SEEN, 0], 3, sparse=[True, False, False], numel=[5, 6, 7])
    assert Observation.decode(o.encode(), 3) == o


def test_link_classes_lie_far_from_the_rates_links_deliver() -> None:
    gbit = 125e6 * 0.93  # 1 Gbit/s of payload
    assert link_class(gbit) == "slow" and not borderline(gbit)
    assert link_class(10 * gbit) == "fast" and not borderline(10 * gbit)
    assert link_class(0.0) == "slow"  # nothing measured: small buckets are never wrong by much
    assert borderline(240e6) and borderline(300e6)


def test_250_mb_per_s_is_where_a_link_turns_fast() -> None:
    assert link_class(250e6) == "fast"
    assert link_class(249.9e6) == "slow"


@pytest.mark.parametrize(("cls", "cap_mib"), [("fast", 32), ("slow", 4)])
def test_the_link_class_caps_buckets_below_the_fusion_threshold(cls: str, cap_mib: int) -> None:
    """docs/glossary.md (Link class): a fast link's buckets hold up to 32 MiB, a slow one's up
    to 4 MiB, though the fusion threshold (64 MiB) allows more. The planner's own agreement
    on 40 parameters of 1 MiB, one rank's observation (no process group needed)."""
    n, numel = 40, (1 << 20) // 4
    config = Config(link_class=cls, fusion_threshold_bytes=64 << 20)
    planner = Planner(SimpleNamespace(size=1, included=True), config, None, overlap=False)
    planner.set_params(
        [torch.nn.Parameter(torch.zeros(numel)) for _ in range(n)], [f"p{i}" for i in range(n)]
    )
    planner._observed = [_obs(list(range(n)), n, numel=[numel] * n)]
    plan = planner._agree(MIN_TIMED_BUCKET_BYTES)
    assert [b.nbytes for b in plan.buckets] == [cap_mib << 20] * (n // cap_mib) + (
        [(n % cap_mib) << 20] if n % cap_mib else []
    )


def test_without_a_cycle_time_readiness_gaps_never_cut() -> None:
    """What the reproducible engine relies on: the plan is the same whatever the timing."""
    specs = _specs([MIN_TIMED_BUCKET_BYTES // 4] * 4)
    plans = {
        agree(
            specs,
            [_obs([0, 1, 2, 3], 4, ready=ready, numel=[s.numel for s in specs])],
            threshold_bytes=1 << 30,
            cycle_time_ms=0.0,
        ).digest
        for ready in ([0, 10, 20, 30], [0, 50_000, 90_000, 300_000])
    }
    assert len(plans) == 1
