"""The fused path: chunked, pipelined packing; reduction in place; cached requests."""

from __future__ import annotations

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives import execute
from ringtrain.testing.spawn import RankFailed, World


def _fused_chunks(chunk_bytes: int) -> None:
    saved, execute.PIPELINE_CHUNK_BYTES = execute.PIPELINE_CHUNK_BYTES, chunk_bytes
    try:
        _check_fused()
    finally:  # the rank processes outlive this test
        execute.PIPELINE_CHUNK_BYTES = saved


def _check_fused() -> None:
    r, n = rt.rank(), rt.size()
    shapes = [(7,), (3, 5), (1,), (40,), (2, 2, 2), (129,)] * 5
    floats = [torch.full(s, float(r + i)) for i, s in enumerate(shapes)]
    got = rt.grouped_allreduce(floats, op=rt.Average, prescale_factor=2.0, postscale_factor=0.5)
    for i, (s, g) in enumerate(zip(shapes, got)):
        torch.testing.assert_close(g, torch.full(s, (n - 1) / 2 + i))
    ints = [torch.full(s, r + 3 * i, dtype=torch.int32) for i, s in enumerate(shapes)]
    rt.grouped_allreduce_(ints, op=rt.Average)  # integer Average truncates (Horovod), per chunk
    for i, t in enumerate(ints):
        assert t.dtype == torch.int32
        assert int(t.flatten()[0]) == (sum(range(n)) + 3 * i * n) // n
    big = [torch.full(s, 2**62 + r, dtype=torch.uint64) for s in shapes]  # no in-place path
    rt.grouped_allreduce_(big, op=rt.Max)
    assert all(int(t.flatten()[0]) == 2**62 + n - 1 for t in big)


def test_chunks_are_runs_of_whole_tensors_in_order() -> None:
    assert execute._chunks([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert execute._chunks([10, 1, 1], 8) == [range(0, 1), range(1, 3)]  # never split a tensor
    assert execute._chunks([3], 8) == [range(0, 1)]


@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
def test_chunked_fusion_is_exact(world: World, chunk_bytes: int) -> None:
    world.run(_fused_chunks, chunk_bytes)


def _in_place_without_copies() -> None:
    t = torch.full((1000,), float(rt.rank()))
    before = t.data_ptr()
    out = rt.allreduce_(t, op=rt.Sum)
    assert out is t and t.data_ptr() == before
    torch.testing.assert_close(t, torch.full((1000,), float(sum(range(rt.size())))))
    x = torch.ones(3)
    y = rt.allreduce(x, op=rt.Sum)  # out of place: the input is left alone
    assert y is not x and x.tolist() == [1.0, 1.0, 1.0] and y.tolist() == [rt.size()] * 3


def test_single_tensor_is_reduced_where_it_lies(world: World) -> None:
    world.run(_in_place_without_copies)


def test_one_block_spans_views_that_lie_back_to_back() -> None:
    flat = torch.zeros(30)
    views = [flat[0:10], flat[10:25].view(3, 5), flat[25:30]]
    whole = execute.one_block(views, views)
    assert whole is not None and whole.data_ptr() == flat.data_ptr() and whole.numel() == 30
    assert execute.one_block(views[::-1], views[::-1]) is None  # out of order
    gap = [flat[0:10], flat[11:20]]
    assert execute.one_block(gap, gap) is None
    apart = [torch.zeros(5), torch.zeros(5)]
    assert execute.one_block(apart, apart) is None
    copies = [v.clone() for v in views]
    assert execute.one_block(copies, views) is None  # out of place


def _views_of_one_buffer() -> None:
    n = rt.size()
    flat = torch.arange(4 * 4096, dtype=torch.float32) * (rt.rank() + 1)
    views = list(flat.split(4096))
    saved = execute.Executor._fusion_buffer

    def no_packing(*args: object) -> torch.Tensor:
        raise AssertionError("views of one buffer were packed")

    execute.Executor._fusion_buffer = no_packing  # type: ignore[method-assign]
    try:
        rt.grouped_allreduce_(views, op=rt.Average, postscale_factor=2.0)
    finally:
        execute.Executor._fusion_buffer = saved  # type: ignore[method-assign]
    factor = 2.0 * sum(range(1, n + 1)) / n
    torch.testing.assert_close(flat, torch.arange(4 * 4096, dtype=torch.float32) * factor)


def test_grouped_views_of_one_buffer_are_reduced_where_they_lie(world: World) -> None:
    world.run(_views_of_one_buffer)


def _layouts_kept_and_changed() -> None:
    """The fused path keeps its buffer's views by the tensors' shapes: the same numbers of
    elements in other shapes, and more layouts than it keeps, then each again, all exact."""
    executor = rt.global_process_set.communicator.service("controller")._executor
    r, n = rt.rank(), rt.size()
    # Over inline.INLINE_MAX_BYTES, so that they take the fused path.
    layouts = [[(30, 50), (1600,)], [(1500,), (40, 40)], [(1600,), (30, 50)]]
    layouts += [[(k + 1, 1024), (2, 3)] for k in range(execute.KEPT_LAYOUTS)]
    for rep, shapes in enumerate(layouts * 2):
        ts = [torch.full(s, float(r + rep + i)) for i, s in enumerate(shapes)]
        rt.grouped_allreduce_(ts, op=rt.Sum)
        for i, (s, t) in enumerate(zip(shapes, ts)):
            assert t.shape == s
            torch.testing.assert_close(t, torch.full(s, float(sum(range(n)) + n * (rep + i))))
    assert 1 <= len(executor._layouts) <= execute.KEPT_LAYOUTS


def test_repeated_and_changed_layouts_are_exact(world: World) -> None:
    world.run(_layouts_kept_and_changed)


def _cached_then_changed() -> None:
    ctl = rt.global_process_set.communicator.service("controller")
    for _step in range(3):  # the same named ops every step: negotiated by cache number
        hs = [rt.allreduce_async(torch.ones(4), name=f"grad.{i}", op=rt.Sum) for i in range(5)]
        for h in hs:
            assert rt.synchronize(h).tolist() == [rt.size()] * 4
    assert len(ctl._requests.cache) >= 5
    # A rank now sends a changed request under a cached name: still caught, on every rank.
    rt.allreduce(torch.ones(4 + rt.rank()), name="grad.0", op=rt.Sum)


def test_cached_requests_still_catch_mismatches(world2: World) -> None:
    with pytest.raises(RankFailed) as info:
        world2.run(_cached_then_changed, timeout=60)
    msg = str(info.value)
    for r in range(2):
        assert f"--- rank {r} ---\nCollectiveMismatchError" in msg, msg


def _sums_three_ways(sizes: list[int]) -> list[list[bytes]]:
    """The same allreduces submitted three ways: in a burst (fused, inline or not, as the
    negotiation rounds happen to fall), one at a time, and in a burst again."""
    g = torch.Generator().manual_seed(1234 + rt.rank())
    data = [torch.randn(n, generator=g) * 10.0 ** (i % 5) for i, n in enumerate(sizes)]

    def burst() -> list[torch.Tensor]:
        handles = [rt.allreduce_async(t, op=rt.Average, name=f"t{i}") for i, t in enumerate(data)]
        return [rt.synchronize(h) for h in handles]

    def one_by_one() -> list[torch.Tensor]:
        return [rt.allreduce(t, op=rt.Average, name=f"t{i}") for i, t in enumerate(data)]

    return [[t.numpy().tobytes() for t in run()] for run in (burst, one_by_one, burst)]


def test_async_allreduces_sum_alike_however_they_were_batched(world3: World) -> None:
    """Reproducible by default: at 3 ranks Gloo's ring sums an element in an order set by its
    offset in a fused buffer, so which ops arrive together must not decide what is fused. Small
    ops (some inline, some past the round's inline budget) and large ones are mixed."""
    sizes = [3000, 17, 900, 250_000, 5, 1000, 400, 70_001, 1024, 2, 700, 600]
    results = world3.run(_sums_three_ways, sizes)
    for rank_results in results:
        assert rank_results[0] == rank_results[1] == rank_results[2]
    assert results[0] == results[1] == results[2]


def _mixed_dtypes() -> list[bool]:
    """A grouped allreduce over several dtypes, against each tensor reduced alone: values that
    any other dtype would change (int64 past 2**53, halves, float64's last bits)."""
    r = rt.rank()
    made = [
        torch.tensor([0.5 + r, 1.25], dtype=torch.float32),
        torch.tensor([2**60 + 3 * r, -(2**40) - r], dtype=torch.int64),
        torch.tensor([1 / 3 + r, 1e-17], dtype=torch.float64),
        torch.tensor([7 + r, -3], dtype=torch.int32),
        torch.tensor([0.1 * r, 2.5], dtype=torch.float32),
    ]
    alone = [rt.allreduce(t, op=rt.Sum, name=f"alone.{i}") for i, t in enumerate(made)]
    grouped = rt.grouped_allreduce(made, op=rt.Sum, name="mixed")
    in_place = [t.clone() for t in made]
    rt.grouped_allreduce_(in_place, op=rt.Sum, name="mixed_")
    later = rt.synchronize(rt.grouped_allreduce_async(made, op=rt.Sum, name="mixed.async"))
    averaged = rt.grouped_allreduce(made, op=rt.Average, name="mixed.avg")
    average_alone = [rt.allreduce(t, op=rt.Average, name=f"avg.{i}") for i, t in enumerate(made)]
    return [
        all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(alone, got))
        for got in (grouped, in_place, later)
    ] + [all(torch.equal(a, b) for a, b in zip(average_alone, averaged))]


def test_a_grouped_allreduce_over_several_dtypes_reduces_each_in_its_own(world: World) -> None:
    """Each tensor is reduced in its own dtype, as alone (Horovod fuses only alike tensors):
    the group was reduced in its first tensor's dtype and cast back."""
    for got in world.run(_mixed_dtypes):
        assert got == [True, True, True, True]
