"""Tensors at the edges of what a collective takes, as users pass them: a rank with no rows,
a dimension of size 1 whose stride is not 1, splits that leave rows unsent, objects only
cloudpickle can send, and one that nothing can, in-place results into an expanded tensor. Each case is followed by an ordinary op, so a
failure that leaves the process set stopped shows too. Sizes 1-3, both data paths."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import ringtrain as rt
import ringtrain.torch as hvd
from _inline_paths import PATHS, on
from ringtrain.testing.spawn import RankFailed, World


def _still_works() -> None:
    assert rt.allreduce(torch.ones(1), op=rt.Sum).item() == rt.size()


def _no_rows() -> None:
    r, n = rt.rank(), rt.size()
    # rank r gives r rows: rank 0 none (Horovod: any first dimension per rank)
    out = rt.allgather(torch.full((r, 2), 7.0))
    assert torch.equal(out, torch.full((n * (n - 1) // 2, 2), 7.0))
    # rank 0 sends nothing; every other rank sends one row to each rank
    x = torch.zeros(0, 2) if r == 0 else torch.full((n, 2), float(r))
    got, received = rt.alltoall(x, splits=[0 if r == 0 else 1] * n)
    assert received.tolist() == [0] + [1] * (n - 1)
    assert torch.equal(got, torch.tensor([[float(s)] * 2 for s in range(1, n)]).reshape(-1, 2))
    # no rows anywhere: every rank gets its (empty) share
    for op in (rt.Sum, rt.Average):
        assert rt.reducescatter(torch.zeros(0, 2), op=op).shape == (0, 2)
    assert rt.reducescatter(torch.zeros(3, 0), op=rt.Sum).shape[1:] == (0,)
    _still_works()


@PATHS
def test_ranks_without_rows(world: World, path: str) -> None:
    world.run(on(path, _no_rows))


def _size1_stride() -> None:
    r, n = rt.rank(), rt.size()
    # (3, 1) with strides (1, 3): torch calls it contiguous, its last stride is not 1
    x = (torch.arange(3.0) + 10 * r).reshape(1, 3).t()
    assert x.is_contiguous() and x.stride(-1) != 1
    rows = [torch.arange(3.0) + 10 * k for k in range(n)]
    assert torch.equal(rt.allgather(x), torch.cat(rows).reshape(-1, 1))
    assert torch.equal(rt.broadcast(x, 0), torch.arange(3.0).reshape(3, 1))
    assert torch.equal(rt.allreduce(x, op=rt.Sum), sum(rows).reshape(3, 1))
    got, _ = rt.alltoall(x, splits=[3] + [0] * (n - 1))
    if r == 0:
        assert torch.equal(got, torch.cat(rows).reshape(-1, 1))
    rt.broadcast_(x, 0)
    assert torch.equal(x, torch.arange(3.0).reshape(3, 1))
    _still_works()


@PATHS
def test_size_one_dimension_with_any_stride(world: World, path: str) -> None:
    world.run(on(path, _size1_stride))


def _written_in_place_share_memory() -> list[str]:
    """In-place collectives into a tensor whose elements share memory (``.expand()``) are
    refused at submission with a ValueError, on every rank, and the set goes on: before, the
    result's write failed on the controller's thread, as a peer failure on every rank, and
    every later collective of the set failed."""
    one = torch.tensor([1.0])
    hvd.allreduce_(torch.ones(3), name="in_place.named")  # its repeat below takes no shortcut
    calls = [
        lambda: hvd.allreduce_(one.expand(3)),
        lambda: hvd.allreduce_(one.expand(3), name="in_place.named"),
        lambda: hvd.synchronize(hvd.allreduce_async_(one.expand(3), op=hvd.Sum)),
        lambda: hvd.grouped_allreduce_([torch.ones(2), one.expand(2, 2)]),
        lambda: hvd.broadcast_(one.expand(3), root_rank=0),
        # one rank's tensor only: the other rank raises too, instead of waiting for it
        lambda: hvd.allreduce_(one.expand(3) if hvd.rank() == 0 else torch.ones(3)),
    ]
    said = []
    for call in calls:
        try:
            call()
        except ValueError as e:
            said.append(str(e))
        else:
            said.append("no error")
        _still_works()
    assert one.tolist() == [1.0]
    return said


def test_in_place_into_shared_memory_is_refused_and_the_set_goes_on(world2: World) -> None:
    for said in world2.run(_written_in_place_share_memory, timeout=60):
        assert len(said) == 6, said
        for msg, kind in zip(said, ["allreduce"] * 4 + ["broadcast", "allreduce"]):
            assert f"in-place {kind} cannot write its result into a tensor whose elements" in msg
            assert "strides" in msg and "HINT: pass t.clone() or t.contiguous()" in msg, msg
        assert "(item 1)" in said[3]


def _sparse_embedding() -> None:
    r, n = rt.rank(), rt.size()
    emb = nn.Embedding(5, 2, sparse=True)
    emb(torch.tensor([r, 4])).sum().backward()
    assert emb.weight.grad is not None
    # Horovod's recipe: allgather of the coalesced gradient's indices (a (1, k) tensor's
    # transpose) and values, then the values divided by the size
    out = hvd.sparse_allreduce_async(emb.weight.grad, name="emb.grad", op=hvd.Average)()
    expected = torch.zeros(5)
    for k in range(n):
        expected[k] += 1.0 / n
    expected[4] += 1.0
    assert torch.allclose(out.to_dense()[:, 0], expected)
    _still_works()


def test_sparse_allreduce_of_an_embedding_gradient(world: World) -> None:
    world.run(_sparse_embedding)


def _sparse_of_other_shapes() -> None:
    # Rank r's tensor has 4 + r rows and an entry in its last: only the last rank's holds every
    # index. Unchecked, torch would build sparse tensors whose indices run out of their memory.
    r, n = rt.rank(), rt.size()
    length = 4 + r
    t = torch.sparse_coo_tensor(torch.tensor([[length - 1]]), torch.tensor([1.0]), (length,))
    handle = hvd.sparse_allreduce_async(t, name="lengths", op=hvd.Sum)
    if r < n - 1:
        try:
            handle()
        except ValueError as e:
            assert "sparse_allreduce 'lengths': the ranks' indices do not fit" in str(e), str(e)
            assert f"this rank's shape ({length},)" in str(e) and "one shape" in str(e), str(e)
        else:
            raise AssertionError("indices out of this rank's shape were taken")
    else:
        assert handle().to_dense()[3 : 3 + n].tolist() == [1.0] * n
    _still_works()


def test_sparse_allreduce_of_other_shapes_fails_on_the_rank_they_do_not_fit(world: World) -> None:
    world.run(_sparse_of_other_shapes, timeout=60)


def _splits_below_rows() -> None:
    r, n = rt.rank(), rt.size()
    x = torch.arange(float(n + 2)).reshape(-1, 1).requires_grad_()
    got, received = rt.alltoall(x, splits=[1] * n)  # the last 2 rows are not sent
    assert received.tolist() == [1] * n
    assert got.flatten().tolist() == [float(r)] * n
    got.sum().backward()  # unsent rows get no gradient
    assert x.grad is not None
    assert x.grad.flatten().tolist() == [1.0] * n + [0.0, 0.0]
    _still_works()


def test_alltoall_splits_may_leave_rows_unsent(world: World) -> None:
    world.run(_splits_below_rows)


def _too_many_rows() -> None:
    rt.alltoall(torch.ones(2), splits=[2] * rt.size())


def _two_d_splits() -> None:
    n = rt.size()
    bad = torch.ones(n, 1, dtype=torch.int32) if rt.rank() == 0 else torch.ones(n)
    try:  # one rank's bad splits fail on every rank, as a ValueError
        rt.alltoall(torch.ones(n), splits=bad)
    except ValueError as e:
        assert "must be a whole number of rows per rank (1-D)" in str(e), str(e)
    else:
        raise AssertionError("2-D splits were taken")
    _still_works()


def test_alltoall_splits_of_two_dimensions(world: World) -> None:
    world.run(_two_d_splits, timeout=60)


def _float_splits() -> None:
    # Rank 0's float splits: 1.5 would be cut to 1 and the last row left unsent, silently
    # (Horovod: ValueError, splits must be 32-bit integers); a bool tensor is no count either.
    for bad in (torch.tensor([1.5, 2.5]), torch.tensor([True, True])):
        splits = bad if rt.rank() == 0 else torch.tensor([2, 2])
        try:
            rt.alltoall(torch.arange(4.0), splits=splits)
        except ValueError as e:
            assert "must be a whole number of rows per rank" in str(e), str(e)
            assert "integer tensor" in str(e), str(e)
        else:
            raise AssertionError(f"splits {bad} were taken")
    got, received = rt.alltoall(torch.arange(4.0), splits=torch.tensor([1, 3]))  # int64 is fine
    assert received.tolist() == ([1, 1] if rt.rank() == 0 else [3, 3])
    assert got.tolist() == ([0.0, 0.0] if rt.rank() == 0 else [1.0, 2.0, 3.0] * 2)
    _still_works()


def test_alltoall_float_splits_are_refused(world2: World) -> None:
    world2.run(_float_splits, timeout=60)


def test_alltoall_splits_beyond_the_rows(world2: World) -> None:
    with pytest.raises(RankFailed, match=r"sum to at most dim 0 of the tensor \(2\)"):
        world2.run(_too_many_rows, timeout=60)


def _objects_by_value() -> None:
    scale = 3
    fn = (lambda v: v * scale) if rt.rank() == 0 else None
    got = rt.broadcast_object(fn, 0)
    assert got is not None and got(2) == 6

    class Local:  # a class no other process can import
        def __init__(self, r: int) -> None:
            self.r = r

    assert [o.r for o in rt.allgather_object(Local(rt.rank()))] == list(range(rt.size()))
    _still_works()


@PATHS
def test_objects_travel_by_value(world: World, path: str) -> None:
    world.run(on(path, _objects_by_value))


def _unpicklable(kind: str) -> None:
    lock = threading.Lock()
    try:
        if kind == "broadcast":
            rt.broadcast_object(lock if rt.rank() == 0 else None, 0)
        else:
            rt.allgather_object(lock if rt.rank() == rt.size() - 1 else rt.rank())
    except rt.CollectiveArgumentError as e:  # a ValueError, on every rank, with the reason
        assert "cannot be pickled" in str(e) and "lock" in str(e), str(e)
    else:
        raise AssertionError("an unpicklable object was sent")
    _still_works()


@pytest.mark.parametrize("kind", ["broadcast", "allgather"])
def test_an_unpicklable_object_fails_on_every_rank(world: World, kind: str) -> None:
    world.run(_unpicklable, kind, timeout=90)


def _half_average() -> list[float]:
    # 60000 on every rank: a 16-bit sum overflows fp16 (65504) from 2 ranks, an average does not
    big = rt.allreduce(torch.full((3,), 60000.0, dtype=torch.float16), op=rt.Average)
    return big.float().tolist()


def test_a_16bit_average_divides_before_the_sum(world: World) -> None:
    """Different on purpose (docs/horovod.md): Horovod sums, then scales, so it gives inf."""
    for got in world.run(_half_average):
        assert got == [60000.0] * 3
