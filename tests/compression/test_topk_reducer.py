"""Top-k reducer with error feedback, on 1-3 ranks: exact at ratio 1, the mean of each rank's
top-k otherwise, error feedback bookkeeping, 16-bit values, state round trip, rank-identical."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringtrain.compression import base
from ringtrain.compression.topk import SAMPLE_ABOVE, TopKReducer, top_indices
from ringtrain.errors import CollectiveArgumentError, ConfigError
from ringtrain.testing.spawn import World
from ringtrain.transport import rounds


def test_settings_and_k() -> None:
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ConfigError, match="ratio"):
            TopKReducer(ratio=bad)
    with pytest.raises(ConfigError, match="value_dtype"):
        TopKReducer(value_dtype=torch.int32)
    red = TopKReducer(ratio=0.01)
    assert (red.k_for(1), red.k_for(100), red.k_for(101), red.k_for(10_000)) == (1, 1, 2, 100)
    assert TopKReducer(ratio=1.0).k_for(7) == 7
    assert isinstance(base._REGISTRY["topk"](), TopKReducer)
    with pytest.raises(ConfigError, match="not a top-k"):
        red.load_state_dict({"name": "powersgd", "version": 1})


def _group() -> Any:
    from ringtrain.runtime import state

    return state.current().world.communicator.group("engine")


def _mean(t: torch.Tensor, group: Any) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)


def _bucket(numel: int, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + 7 * step + numel)
    return torch.randn(numel, generator=gen).to(dtype)


def _ratio_one_is_exact() -> None:
    g = _group()
    red = TopKReducer(ratio=1.0)
    for step in range(2):
        for numel, dtype in ((1, torch.float32), (333, torch.float32), (64, torch.float64)):
            flat = _bucket(numel, step, dtype)
            before = flat.clone()
            out = red.reduce(f"b{numel}", flat, rounds(g))
            assert torch.equal(flat, before)
            assert out.dtype == dtype
            torch.testing.assert_close(out, _mean(flat, g))
    assert red.reduce("empty", torch.empty(0), rounds(g)).numel() == 0


def test_ratio_one_equals_exact_average(world: World) -> None:
    world.run(_ratio_one_is_exact)


def _mean_of_each_ranks_top_k(numel: int, ratio: float) -> None:
    g = _group()
    red = TopKReducer(ratio=ratio)
    world = dist.get_world_size(g)
    flat = _bucket(numel, 0)
    out = red.reduce("b", flat, rounds(g))
    # Reference: every rank's own top-k by magnitude (torch.topk), averaged densely.
    k = red.k_for(numel)
    mine = torch.zeros_like(flat)
    idx = flat.abs().topk(k).indices
    mine[idx] = flat[idx]
    torch.testing.assert_close(out, _mean(mine, g))
    assert int((out != 0).sum()) <= k * world
    # The residual is exactly what was not sent.
    residual = red.state_dict()["residuals"]["b"]
    torch.testing.assert_close(residual, flat - mine)
    gathered = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(gathered, out, group=g)
    assert all(torch.equal(o, out) for o in gathered), "ranks disagree on the result"


# 500 entries take torch.topk; 100,000 at 1% the sampled threshold (top_indices).
@pytest.mark.parametrize(("numel", "ratio"), [(500, 0.1), (100_000, 0.01)])
def test_result_is_mean_of_each_ranks_top_k(world: World, numel: int, ratio: float) -> None:
    world.run(_mean_of_each_ranks_top_k, numel, ratio)


def test_sampled_selection_is_the_exact_top_k() -> None:
    gen = torch.Generator().manual_seed(1)
    n = 4 * SAMPLE_ABOVE
    for trial in range(5):
        values = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 3
        for k in (1, n // 1000, n // 100, n // 20):
            got = top_indices(values, k, gen)
            want = values.abs().topk(k).indices
            assert got.numel() == k and set(got.tolist()) == set(want.tolist()), (trial, k)
    # Mostly zeros: the threshold is 0, every entry is a candidate, the nonzeros all win.
    sparse = torch.zeros(n)
    spots = torch.arange(0, n, n // 64)
    sparse[spots] = torch.arange(1.0, 65.0)
    got = top_indices(sparse, 100, gen)
    assert got.numel() == 100 and set(spots.tolist()) <= set(got.tolist())
    # Large ratios go to torch.topk directly.
    assert set(top_indices(values, n // 2, gen).tolist()) == set(
        values.abs().topk(n // 2).indices.tolist()
    )


def _run(red: TopKReducer, steps: range, g: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs, truth = [], []
    signal = torch.linspace(-1, 1, 400) ** 3  # the same on every rank
    for step in steps:
        for key in ("a", "b"):
            flat = signal + 0.3 * _bucket(400, step)
            outs.append(red.reduce(key, flat, rounds(g)))
            truth.append(_mean(flat, g))
    return outs, truth


def _error_feedback(value_dtype: torch.dtype | None) -> tuple[float, float]:
    g = _group()
    drift = {}
    for ef in (True, False):
        red = TopKReducer(ratio=0.05, value_dtype=value_dtype, error_feedback=ef)
        outs, truth = _run(red, range(40), g)
        got, want = sum(outs[::2]), sum(truth[::2])
        assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
        if ef:
            # Sum of results = sum of true means - mean of the last residuals, exactly.
            res = red.state_dict()["residuals"]["a"]
            torch.testing.assert_close(got + _mean(res, g), want, atol=1e-4, rtol=1e-4)
        drift[ef] = float((got - want).norm() / want.norm())
    return drift[True], drift[False]


@pytest.mark.parametrize("value_dtype", [None, torch.float16])
def test_error_feedback_tracks_the_sum_of_true_averages(
    world: World, value_dtype: torch.dtype | None
) -> None:
    for with_ef, without in world.run(_error_feedback, value_dtype):
        assert with_ef < 0.15, with_ef
        assert without > 3 * with_ef, (with_ef, without)


def _state_round_trip() -> None:
    g = _group()
    red = TopKReducer(ratio=0.02, value_dtype=torch.float16)
    _run(red, range(4), g)
    buf = io.BytesIO()
    torch.save(red.state_dict(), buf)
    expected, _ = _run(red, range(4, 8), g)
    buf.seek(0)
    fresh = TopKReducer(ratio=0.02, value_dtype=torch.float16)
    fresh.load_state_dict(torch.load(buf))
    resumed, _ = _run(fresh, range(4, 8), g)
    assert all(torch.equal(a, b) for a, b in zip(expected, resumed, strict=True))
    cold, _ = _run(TopKReducer(ratio=0.02, value_dtype=torch.float16), range(4, 8), g)
    assert not all(torch.equal(a, b) for a, b in zip(expected, cold, strict=True))
    with pytest.raises(CollectiveArgumentError, match="flat floating-point"):
        red.reduce("x", torch.ones(3, dtype=torch.int64), rounds(g))
    # 16-bit buckets keep their dtype; the residual is kept in fp32.
    out = red.reduce("half", torch.ones(100, dtype=torch.bfloat16), rounds(g))
    assert out.dtype == torch.bfloat16
    assert red.state_dict()["residuals"]["half"].dtype == torch.float32


def test_state_dict_round_trip_resumes_identically(world: World) -> None:
    world.run(_state_round_trip)
