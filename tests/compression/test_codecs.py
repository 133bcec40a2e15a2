"""Each codec against the uncompressed path, with stated tolerances, in one process.

Summed codecs (none, fp16, bf16) and the gathered ones (int8, int4) are tensor code; PowerSGD and top-k run their rounds on a
:class:`ringtrain.compression.codec.Rounds` of 3 simulated ranks (threads in this process,
summing in rank order), so the same code the engine runs is checked without starting ranks.
The tolerances, derived here once (``u`` is the wire's unit roundoff, ``eps / 2``):

* a cast to the wire and back is within ``u |x|`` (within half the subnormal spacing below the
  smallest normal);
* int8/int4 round each value within half a step, a step being its block's largest magnitude
  over the level count (127, 7);
* an average of n values divided before the 16-bit sum (the rule: ``compression.averaging``):
  n casts of ``x_i / n`` and n - 1 additions, each within ``u`` times a partial sum of
  magnitudes, so within ``n u mean_i |x_i|`` plus second-order terms, asserted as
  ``2 n u mean_i |x_i|``; and more than float32 would give, so the wire really was 16-bit;
* top-k at ratio 1 is the average within float32's bound above (every entry is sent, each
  rank's added times 1/n); below 1, with error
  feedback, the results over steps plus the average of the final residuals are the average of
  the inputs over steps, within float32's rounding of the running sums;
* PowerSGD at rank r is the average within float32 rounding on matrices of rank at most r.

The narrow wire's overflow rule (``compression.overflow``) is pure here; on ranks, every path
that applies it: tests/compression/test_overflow_paths.py and tests/transport/.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ringtrain.compression import averaging, overflow, resolve, wires
from ringtrain.compression.halfprec import BF16Compressor, FP16Compressor, NoneCompressor
from ringtrain.compression.powersgd import PowerSGDReducer
from ringtrain.compression.quantized import BLOCK, Int4Compressor, Int8Compressor
from ringtrain.compression.topk import TopKReducer

HALF = {"fp16": FP16Compressor, "bf16": BF16Compressor}
N = 3


def _roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


@pytest.mark.parametrize("name", sorted(HALF))
def test_a_cast_and_back_is_within_half_a_unit(name: str) -> None:
    codec = HALF[name]
    info = torch.finfo(codec.cast_to)
    x = torch.randn(10_000, dtype=torch.float32) * torch.logspace(-6, 4, 10_000)
    wire, ctx = codec.compress(x)
    assert wire.dtype == codec.cast_to == codec.wire_dtype(x.dtype) and ctx == torch.float32
    back = codec.decompress(wire, ctx)
    assert back.dtype == torch.float32
    bound = torch.maximum(x.abs() * _roundoff(codec.cast_to), torch.tensor(info.tiny * info.eps))
    assert bool(((back - x).abs() <= bound).all())
    assert bool((back != x).any())  # it did round


@pytest.mark.parametrize("name", [*sorted(HALF), "none"])
def test_non_float_tensors_pass_through(name: str) -> None:
    codec = HALF.get(name, NoneCompressor)
    t = torch.arange(6, dtype=torch.int32)
    wire, ctx = codec.compress(t)
    assert wire is t and codec.wire_dtype(torch.int32) == torch.int32
    assert codec.decompress(wire, ctx) is t


def _average_on_the_wire(codec: Any, xs: list[torch.Tensor]) -> torch.Tensor:
    """What the engine's 16-bit path does for n ranks: divide, cast, sum in the wire dtype in
    rank order, decode."""
    wires = [codec.compress(averaging.mean(x.clone(), len(xs)))[0] for x in xs]
    total = wires[0].clone()
    for w in wires[1:]:
        total += w
    return codec.decompress(total, xs[0].dtype)


@pytest.mark.parametrize("name", sorted(HALF))
def test_a_16_bit_average_is_within_the_stated_bound(name: str) -> None:
    codec = HALF[name]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(10_000, generator=g) * 100 for _ in range(N)]
    exact = torch.stack([x.double() for x in xs]).mean(0)
    mean_abs = torch.stack([x.double().abs() for x in xs]).mean(0)
    got = _average_on_the_wire(codec, xs).double()
    err = (got - exact).abs()
    assert bool((err <= 2 * N * _roundoff(codec.cast_to) * mean_abs).all())
    # float32's own error would stay below 2 N u32 mean|x|: the wire was narrower.
    assert bool((err > 2 * N * _roundoff(torch.float32) * mean_abs).any())
    plain = _average_on_the_wire(NoneCompressor, xs).double()
    assert bool(((plain - exact).abs() <= 2 * N * _roundoff(torch.float32) * mean_abs).all())


QUANTIZED = {"int8": Int8Compressor, "int4": Int4Compressor}


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_a_quantized_wire_rounds_within_half_a_level(name: str) -> None:
    """Per block of BLOCK values, the step is the block's largest magnitude M over the levels;
    each value is within half a step, plus float32's rounding: the scale's (u of the step), the
    division's and the product's (u of M each: a value near M is near levels x the scale)."""
    codec = QUANTIZED[name]
    u = _roundoff(torch.float32)
    for seed in range(20):  # many blocks' worth of values near a rounding boundary
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(1000, generator=g) * torch.linspace(0.01, 10, 1000)
        x[:BLOCK] = 0.0  # a block of zeros: scale 0, decoded exactly
        payload, numel = codec.compress(x)
        assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes(1000)
        assert codec.payload_bytes(1000) < x.numel() * 4 * codec.bits / 32 * 1.1  # + scales
        back = codec.decompress(payload, numel)
        assert back.dtype == torch.float32 and back.shape == x.shape
        for block in range(0, 1000, BLOCK):
            part = slice(block, block + BLOCK)
            most = float(x[part].abs().max())
            step = most / codec.levels
            err = float((back[part] - x[part]).abs().max())
            bound = step / 2 * (1 + u) + 2 * most * u * (1 + u)
            assert err <= bound, (name, seed, block, err, step)
        assert torch.equal(back[:BLOCK], x[:BLOCK])


def test_every_outer_wire_is_a_registered_codec() -> None:
    """The outer exchange's names (Config.outer_compression) are the wires' table: the summed
    ones are the gradient codecs themselves, the gathered ones beside them."""
    assert {
        "none": NoneCompressor,
        "fp16": FP16Compressor,
        "bf16": BF16Compressor,
        "int8": Int8Compressor,
        "int4": Int4Compressor,
    } == wires.WIRES
    for name in ("none", "fp16", "bf16"):
        assert type(resolve(name)) is wires.WIRES[name]


# ---- the overflow rule ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_overflow_check_finds_every_non_finite_value(dtype: torch.dtype) -> None:
    big = float(torch.finfo(dtype).max)
    x = torch.randn(10_000).to(dtype)
    assert overflow.all_finite(x)
    for bad in ([float("inf")], [float("-inf")], [float("nan")], [float("inf"), float("-inf")]):
        y = x.clone()
        y[-len(bad) :] = torch.tensor(bad, dtype=dtype)
        assert not overflow.all_finite(y), bad
    # The largest finite values are finite (a sum of them would overflow).
    assert overflow.all_finite(torch.full((8,), big, dtype=dtype))
    assert overflow.all_finite(torch.empty(0, dtype=dtype))


def test_narrower_wires_are_those_with_a_smaller_range() -> None:
    f16, b16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    assert overflow.narrower(f16, f32) and overflow.narrower(b16, f32)
    assert overflow.narrower(f16, b16) and overflow.narrower(f32, f64)
    assert not overflow.narrower(f32, f32) and not overflow.narrower(f64, f32)
    assert not overflow.narrower(None, f32) and not overflow.narrower(torch.int32, torch.int64)
    for name, codec in HALF.items():  # every 16-bit codec's wire has the rule
        assert overflow.narrower(codec.wire_dtype(f32), f32), name


def test_the_redo_follows_the_agreement_not_the_local_view() -> None:
    finite, inf = torch.ones(4), torch.tensor([1.0, float("inf")])
    redone: list[int] = []
    # Without agreement (an allreduce's result, the same everywhere): the local view decides.
    assert not overflow.redo_if_not_finite(finite, lambda: redone.append(1))
    assert overflow.redo_if_not_finite(inf, lambda: redone.append(2))
    assert redone == [2]
    # With one (a reduce-scatter's shard): called on every rank, overflow or not, and obeyed.
    asked: list[bool] = []

    def agree(answer: bool) -> Callable[[bool], bool]:
        def ask(here: bool) -> bool:
            asked.append(here)
            return answer

        return ask

    assert overflow.redo_if_not_finite(finite, lambda: redone.append(3), agree(True))
    assert not overflow.redo_if_not_finite(inf, lambda: redone.append(4), agree(False))
    assert asked == [False, True] and redone == [2, 3]


def test_any_rank_is_one_max_over_the_ranks() -> None:
    for other in (0.0, 1.0):  # what the other ranks send
        sent: list[float] = []

        def allreduce_max(flag: torch.Tensor, other: float = other, sent: list = sent) -> None:
            sent.append(float(flag))
            flag.clamp_(min=other)

        assert overflow.any_rank(allreduce_max)(False) == (other == 1.0)
        assert overflow.any_rank(allreduce_max)(True)
        assert sent == [0.0, 1.0]


# ---- codecs with rounds of their own, on simulated ranks -------------------------------------


class _Done:
    def wait(self) -> None:
        return None


class _Board:
    """What the simulated ranks share: a slot per rank and a barrier."""

    def __init__(self, size: int) -> None:
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)


class _ThreadRounds:
    """:class:`ringtrain.compression.codec.Rounds` for one of ``size`` threads: every
    collective posts this rank's tensor, waits for all, and combines them in rank order."""

    group = None

    def __init__(self, board: _Board, rank: int) -> None:
        self.board, self.rank, self.size = board, rank, len(board.slots)

    def _everyone(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.board.slots[self.rank] = t.clone()
        self.board.barrier.wait()
        every = list(self.board.slots)
        self.board.barrier.wait()  # nobody posts the next round before all have read this one
        return every

    def allreduce(self, t: torch.Tensor) -> _Done:
        every = self._everyone(t)
        total = every[0].clone()  # the posted tensors are shared: read, never written
        for other in every[1:]:
            total += other
        t.copy_(total)
        return _Done()

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> _Done:
        out.copy_(torch.cat(self._everyone(t)))
        return _Done()

    def all_gather(self, outs: list[torch.Tensor], t: torch.Tensor) -> _Done:
        for o, e in zip(outs, self._everyone(t)):
            o.copy_(e)
        return _Done()


def _on_ranks(fn: Callable[[int, _ThreadRounds], Any], size: int = N) -> list[Any]:
    """``fn(rank, rounds)`` on ``size`` simulated ranks; their results in rank order."""
    board = _Board(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, _ThreadRounds(board, rank))
        except BaseException as e:  # reported below
            errors.append(e)
            board.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def _grads(step: int, rank: int, numel: int = 4000) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))


def _mean(step: int, numel: int = 4000) -> torch.Tensor:
    return torch.stack([_grads(step, r, numel).double() for r in range(N)]).mean(0)


def test_top_k_at_ratio_one_is_the_float32_average() -> None:
    def run(rank: int, rounds: _ThreadRounds) -> torch.Tensor:
        return TopKReducer(ratio=1.0).reduce("b0", _grads(0, rank), rounds)

    results = _on_ranks(run)
    assert all(torch.equal(got, results[0]) for got in results)  # alike on every rank
    mean_abs = torch.stack([_grads(0, r).double().abs() for r in range(N)]).mean(0)
    err = (results[0].double() - _mean(0)).abs()
    assert bool((err <= 2 * N * _roundoff(torch.float32) * mean_abs).all())


def test_top_k_error_feedback_loses_nothing_over_steps() -> None:
    steps = 6

    def run(rank: int, rounds: _ThreadRounds) -> tuple[torch.Tensor, torch.Tensor]:
        red = TopKReducer(ratio=0.05)
        total = torch.zeros(4000, dtype=torch.float64)
        for step in range(steps):
            total += red.reduce("b0", _grads(step, rank), rounds).double()
        return total, red.state_dict()["residuals"]["b0"].double()

    results = _on_ranks(run)
    sent = results[0][0]
    assert all(torch.equal(total, sent) for total, _ in results)  # alike on every rank
    owed = torch.stack([residual for _, residual in results]).mean(0)
    exact = sum((_mean(step) for step in range(steps)), torch.zeros(4000, dtype=torch.float64))
    # float32 running sums of magnitude up to ~steps * |g|: a few units of float32 roundoff.
    tol = 4 * steps * _roundoff(torch.float32) * float(exact.abs().max() + owed.abs().max())
    assert float((sent + owed - exact).abs().max()) <= tol
    assert float(owed.abs().max()) > 1e3 * tol  # something really was held back


def test_power_sgd_is_the_average_on_low_rank_gradients() -> None:
    rows, cols, rank_r = 64, 48, 2

    def low_rank(rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7 + rank)
        return torch.randn(rows, rank_r, generator=g) @ torch.randn(rank_r, cols, generator=g)

    # Every rank's matrix in one rank-r column space, so their average has rank r too.
    basis = torch.randn(rows, rank_r, generator=torch.Generator().manual_seed(3))

    def grad(rank: int) -> torch.Tensor:
        return (basis @ torch.linalg.pinv(basis) @ low_rank(rank)).reshape(-1)

    def run(rank: int, rounds: _ThreadRounds) -> torch.Tensor:
        red = PowerSGDReducer(matrix_approximation_rank=rank_r, start_iter=0)
        red.plan("b0", [(rows, cols)])
        out = red.reduce("b0", grad(rank), rounds)
        layout = red.layout("b0")
        assert layout is not None and layout.matrices  # compressed
        return out

    results = _on_ranks(run)
    exact = torch.stack([grad(r).double() for r in range(N)]).mean(0)
    scale = float(exact.abs().max())
    for got in results:
        assert torch.equal(got, results[0])
        assert float((got.double() - exact).abs().max()) <= 1e3 * _roundoff(torch.float32) * scale
