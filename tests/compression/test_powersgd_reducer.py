"""PowerSGD reducer: the layout rules, orthogonalization, and on 1-3 ranks: exact on low-rank
gradients, error feedback, warm-up, state round trip, several buckets, rank-identical results."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringtrain.compression import base
from ringtrain.compression.powersgd import PowerSGDReducer, make_layout, orthogonalize
from ringtrain.errors import CollectiveArgumentError, ConfigError
from ringtrain.testing.spawn import World
from ringtrain.transport import rounds

# -- pure ---------------------------------------------------------------------------------------


def test_layout_compresses_only_worthwhile_matrices() -> None:
    shapes = [(64, 32), (32,), (8, 8), (16, 16, 3, 3), (5,), (64, 32)]
    lay = make_layout(shapes, 64 * 32 * 2 + 32 + 64 + 16 * 144 + 5, 2, 2.0)
    # (8, 8) at rank 2: (8 + 8) * 2 * 2 = 64, not < 64 -> sent whole, merged with the bias.
    assert lay.plain == ((2048, 32 + 64), (2048 + 96 + 2304, 5))
    # Same-shape matrices are batched together, wherever they sit in the bucket.
    assert [(g.rows, g.cols, g.rank, g.offsets) for g in lay.matrices] == [
        (64, 32, 2, (0, 2048 + 96 + 2304 + 5)),
        (16, 144, 2, (2048 + 96,)),
    ]
    assert lay.padded == lay.numel
    assert lay.p_numel == 2 * 64 * 2 + 16 * 2 and lay.q_numel == 2 * 32 * 2 + 144 * 2
    assert lay.wire_numel == 101 + lay.p_numel + lay.q_numel
    with pytest.raises(CollectiveArgumentError, match="shapes totalling"):
        make_layout([(4, 4)], 17, 1, 2.0)


def test_layout_without_shapes_is_one_padded_matrix() -> None:
    lay = make_layout(None, 1000, 1, 2.0)
    (g,) = lay.matrices
    assert g.rows * g.cols == lay.padded >= 1000 and g.rows == 31
    assert make_layout(None, 3, 1, 2.0).matrices == ()  # too small to be worth it


def test_orthogonalize_is_safe_on_zeros_and_rank_deficiency() -> None:
    zero = torch.zeros(2, 7, 1)
    assert torch.equal(orthogonalize(zero), zero)
    dependent = torch.randn(3, 9, 1) @ torch.randn(3, 1, 4)  # rank 1, asked for 4 columns
    q = orthogonalize(dependent)
    eye = torch.eye(4).expand(3, 4, 4)
    torch.testing.assert_close(q.transpose(1, 2) @ q, eye, atol=1e-5, rtol=0)
    assert torch.isfinite(orthogonalize(torch.zeros(1, 6, 3))).all()


def test_rejects_bad_settings() -> None:
    with pytest.raises(ConfigError, match="matrix_approximation_rank"):
        PowerSGDReducer(matrix_approximation_rank=0)
    with pytest.raises(ConfigError, match="start_iter"):
        PowerSGDReducer(start_iter=-1)
    with pytest.raises(ConfigError, match="not a PowerSGD"):
        PowerSGDReducer().load_state_dict({"name": "topk", "version": 1})
    assert isinstance(base._REGISTRY["powersgd"](), PowerSGDReducer)


# -- on ranks -----------------------------------------------------------------------------------


def _group() -> Any:
    from ringtrain.runtime import state

    return state.current().world.communicator.group("engine")


def _mean(t: torch.Tensor, group: Any) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t / dist.get_world_size(group)


def _same_on_all_ranks(t: torch.Tensor, group: Any) -> None:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    for o in out:
        assert torch.equal(o, t), "ranks disagree on the reduced bucket"


BUCKETS = {
    # a (64, 32) and a conv (16, 16, 3, 3), both compressed, with small tensors sent whole
    "b0": [(64, 32), (32,)],
    "b1": [(8, 8), (16, 16, 3, 3), (16,)],
}


def _low_rank_bucket(shapes: list[tuple[int, ...]], rank: int, step: int) -> torch.Tensor:
    """Matrices U V_w^T: column space U shared by all ranks (so the mean has rank <= r)."""
    common = torch.Generator().manual_seed(step)
    own = torch.Generator().manual_seed(1000 + 100 * dist.get_rank() + step)
    parts = []
    for shape in shapes:
        if len(shape) >= 2:
            rows, cols = shape[0], int(torch.tensor(shape[1:]).prod())
            u = torch.randn(rows, rank, generator=common)
            parts.append((u @ torch.randn(rank, cols, generator=own)).reshape(-1))
        else:
            parts.append(torch.randn(shape, generator=own))
    return torch.cat(parts)


def _exact_on_low_rank() -> None:
    g = _group()
    # Error feedback on: exact from the first compressed step (random Q).
    fed = PowerSGDReducer(matrix_approximation_rank=2, start_iter=0)
    # Off for later steps: with it on, each result also carries the previous step's residual
    # (by design), so it is no longer this step's mean alone.
    plain = PowerSGDReducer(matrix_approximation_rank=2, start_iter=0, error_feedback=False)
    for key, shapes in BUCKETS.items():
        fed.plan(key, shapes)
        plain.plan(key, shapes)
    for step in range(3):  # step 0 from a random Q, then warm-started from the last Q
        for key, shapes in BUCKETS.items():
            flat = _low_rank_bucket(shapes, 2, step)
            before = flat.clone()
            reducers = [plain, fed] if step == 0 else [plain]
            for red in reducers:
                out = red.reduce(key, flat, rounds(g))
                assert torch.equal(flat, before), "reduce must not modify its input"
                assert out.dtype == flat.dtype and out.shape == flat.shape
                torch.testing.assert_close(out, _mean(flat, g), atol=1e-4, rtol=1e-4)
                _same_on_all_ranks(out, g)
    assert plain.stats()["ratio"] > 2


def test_exact_on_low_rank_gradients(world: World) -> None:
    world.run(_exact_on_low_rank)


def _signal(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fixed full-rank gradient whose singular values halve one after the other, as real
    gradients' spectra decay."""
    gen = torch.Generator().manual_seed(seed)
    if len(shape) < 2:
        return torch.randn(shape, generator=gen)
    rows, cols = shape[0], int(torch.tensor(shape[1:]).prod())
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(rows, k, generator=gen)).Q
    v = torch.linalg.qr(torch.randn(cols, k, generator=gen)).Q
    return ((u * 0.5 ** torch.arange(k)) @ v.T).reshape(-1) * rows


def _run_steps(red: Any, steps: range, g: Any) -> list[torch.Tensor]:
    """The fixed signal plus per-rank noise, two buckets per step; returns every result."""
    outs = []
    for step in steps:
        for key, shapes in BUCKETS.items():
            signal = torch.cat([_signal(s, i) for i, s in enumerate(shapes)])
            gen = torch.Generator().manual_seed(10_000 * dist.get_rank() + 10 * step + len(key))
            noise = torch.randn(signal.numel(), generator=gen)
            flat = signal + 0.3 * signal.norm() / signal.numel() ** 0.5 * noise
            outs.append(red.reduce(key, flat, rounds(g), shapes=shapes))
    return outs


def _warmup_then_compressed() -> None:
    g = _group()
    red = PowerSGDReducer(matrix_approximation_rank=1, start_iter=2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    flats = [torch.randn(64 * 32, generator=gen) for _ in range(3)]
    for i, flat in enumerate(flats):
        out = red.reduce("w", flat, rounds(g), shapes=[(64, 32)])
        exact = torch.allclose(out, _mean(flat, g), atol=1e-6)
        assert exact == (i < 2), f"call {i}: exact={exact}, start_iter=2"


def test_plain_allreduce_before_start_iter(world: World) -> None:
    world.run(_warmup_then_compressed)


def _error_feedback() -> tuple[float, float]:
    g = _group()
    steps = 30
    drift = {}
    for ef in (True, False):
        red = PowerSGDReducer(matrix_approximation_rank=1, start_iter=0, error_feedback=ef)
        outs = _run_steps(red, range(steps), g)
        truth = _run_steps(_Exact(), range(steps), g)
        sums = {}
        for key_i, key in enumerate(BUCKETS):
            got = torch.stack(outs[key_i :: len(BUCKETS)]).sum(0)
            want = torch.stack(truth[key_i :: len(BUCKETS)]).sum(0)
            sums[key] = (got, want)
            if ef:
                # Exact bookkeeping: sum of results = sum of true means - mean of last errors.
                err = red.state_dict()["buckets"][key]["error"]
                torch.testing.assert_close(got + _mean(err, g), want, atol=1e-3, rtol=1e-4)
        got = torch.cat([s[0] for s in sums.values()])
        want = torch.cat([s[1] for s in sums.values()])
        drift[ef] = float((got - want).norm() / want.norm())
    return drift[True], drift[False]


class _Exact:
    """The reference: a plain averaging allreduce with the reducer's signature."""

    def reduce(self, key: str, flat: torch.Tensor, rounds: Any, shapes: Any = None) -> torch.Tensor:
        return _mean(flat, rounds.group)


def test_error_feedback_tracks_the_sum_of_true_averages(world: World) -> None:
    for with_ef, without in world.run(_error_feedback):
        # Without feedback rank-1 loses most of the signal every step; with it, the loss is
        # only delayed, so the summed results stay close to the summed true means.
        assert with_ef < 0.15, with_ef
        assert without > 3 * with_ef, (with_ef, without)


def _state_round_trip() -> None:
    g = _group()
    red = PowerSGDReducer(matrix_approximation_rank=2, start_iter=3)
    _run_steps(red, range(5), g)
    buf = io.BytesIO()
    torch.save(red.state_dict(), buf)
    expected = _run_steps(red, range(5, 10), g)
    buf.seek(0)
    fresh = PowerSGDReducer(matrix_approximation_rank=2, start_iter=3)
    fresh.load_state_dict(torch.load(buf))
    # A checkpoint of a reducer that has not reduced since loading is the loaded one.
    assert fresh.state_dict()["buckets"].keys() == red.state_dict()["buckets"].keys()
    resumed = _run_steps(fresh, range(5, 10), g)
    for a, b in zip(expected, resumed, strict=True):
        assert torch.equal(a, b)
    # Without the state, the continuation differs (the error feedback is lost).
    cold = _run_steps(PowerSGDReducer(matrix_approximation_rank=2, start_iter=0), range(5, 10), g)
    assert not all(torch.equal(a, b) for a, b in zip(expected, cold, strict=True))


def test_state_dict_round_trip_resumes_identically(world: World) -> None:
    world.run(_state_round_trip)


def _shapes_change_and_dtypes() -> None:
    g = _group()
    red = PowerSGDReducer(matrix_approximation_rank=1, start_iter=0)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        flat = _low_rank_bucket([(32, 48)], 1, 0).to(dtype)
        out = red.reduce(f"k{dtype}", flat, rounds(g), shapes=[(32, 48)])
        assert out.dtype == dtype
        tol = 1e-2 if dtype.itemsize == 2 else 1e-6
        torch.testing.assert_close(out, _mean(flat, g), atol=tol * 10, rtol=tol)
    # The same key with new shapes is re-planned (error and warm start reset), not misread.
    out = red.reduce("k", torch.ones(10), rounds(g), shapes=[(10,)])
    torch.testing.assert_close(out, torch.ones(10))
    out = red.reduce("k", torch.ones(24 * 24), rounds(g), shapes=[(24, 24)])
    torch.testing.assert_close(out, torch.ones(24 * 24), atol=1e-5, rtol=1e-5)  # rank 1 exactly
    # Without shapes: one near-square matrix, 31 x 33 here, so a constant bucket is rank 1.
    flat = torch.full((31 * 33,), float(dist.get_rank() + 1))
    out = red.reduce("noshape", flat, rounds(g))
    assert red.layout("noshape").matrices[0].rows == 31
    torch.testing.assert_close(out, _mean(flat, g), atol=1e-5, rtol=1e-5)
    # ... zero-padded when the size does not factor (the padding never leaks out).
    out = red.reduce("padded", torch.randn(1000), rounds(g))
    assert out.shape == (1000,) and torch.isfinite(out).all()
    assert red.layout("padded").padded > 1000
    with pytest.raises(CollectiveArgumentError, match="flat floating-point"):
        red.reduce("bad", torch.ones(2, 2), rounds(g))
    st = copy.deepcopy(red.state_dict())
    assert set(st["buckets"]) >= {"k", "noshape", "padded"}


def test_dtypes_reshaping_and_fallback(world: World) -> None:
    world.run(_shapes_change_and_dtypes)
