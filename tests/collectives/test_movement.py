"""allgather, broadcast, reducescatter, alltoall and object collectives; sizes 1-3."""

from __future__ import annotations

import pytest
import torch

import ringtrain as rt
from _inline_paths import PATHS, inline_ops, on
from ringtrain.collectives import inline
from ringtrain.testing.spawn import RankFailed, World


def _allgather() -> None:
    r, n = rt.rank(), rt.size()
    # first dimension differs per rank
    out = rt.allgather(torch.full((r + 1, 2), r, dtype=torch.int16))
    expected = torch.cat([torch.full((k + 1, 2), k, dtype=torch.int16) for k in range(n)])
    assert out.dtype == torch.int16 and torch.equal(out, expected)
    outs = rt.grouped_allgather([torch.ones(1) * r, torch.tensor([[r, r]])])
    assert outs[0].tolist() == [float(k) for k in range(n)]
    assert outs[1].shape == (n, 2)
    h = rt.allgather_async(torch.tensor([True]), name="ag.bool")
    assert rt.synchronize(h).tolist() == [True] * n
    # autograd, as Horovod: the gradient is averaged over the ranks, then each keeps its rows
    x = torch.ones(2, requires_grad=True)
    rt.allgather(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2))


@PATHS
def test_allgather(world: World, path: str) -> None:
    world.run(on(path, _allgather))


def _allgather_path() -> list[int]:
    counts = []
    for rows in (1, inline.INLINE_MAX_BYTES // 8 + 1):  # 8 bytes a row
        mine = torch.full((rows + rt.rank(), 2), rt.rank(), dtype=torch.int32)
        got, count = inline_ops(lambda mine=mine: rt.allgather(mine))
        assert got.shape == (rt.size() * rows + 1, 2) and got[-1].tolist() == [1, 1]
        counts.append(count)
    return counts


def test_small_allgathers_travel_in_the_negotiation(world2: World) -> None:
    for counts in world2.run(_allgather_path):
        assert counts == [1, 0]


def _broadcast() -> None:
    r, n = rt.rank(), rt.size()
    root = n - 1
    t = torch.full((2, 3), float(r))
    assert torch.equal(rt.broadcast(t, root), torch.full((2, 3), float(root)))
    assert torch.equal(t, torch.full((2, 3), float(r))), "out-of-place broadcast changed its input"
    rt.broadcast_(t, 0)
    assert torch.equal(t, torch.zeros(2, 3))
    for dt in (torch.bfloat16, torch.uint32, torch.complex64, torch.bool):
        x = torch.ones(3).to(dt) if r == 0 else torch.zeros(3).to(dt)
        assert torch.equal(rt.broadcast(x, 0), torch.ones(3).to(dt))
    h = rt.broadcast_async_(torch.tensor([r]), 0, name="b.async")
    assert rt.synchronize(h).item() == 0
    # non-contiguous in place: refused on every rank, as Horovod's, and left as it was
    m = torch.full((3, 4), float(r)).t()
    with pytest.raises(ValueError, match="broadcast needs contiguous tensors"):
        rt.broadcast_(m, 0)
    assert torch.equal(m, torch.full((4, 3), float(r)))


@PATHS
def test_broadcast(world: World, path: str) -> None:
    world.run(on(path, _broadcast))


def _bad_root() -> None:
    rt.broadcast(torch.ones(1), root_rank=7)


def test_bad_root_rank(world2: World) -> None:
    with pytest.raises(RankFailed) as info:
        world2.run(_bad_root, timeout=30)
    assert (
        str(info.value).count("root_rank 7 is not a member of the process set (ranks [0, 1])") >= 2
    )


def _reducescatter() -> None:
    r, n = rt.rank(), rt.size()
    rows = 2 * n + 1  # uneven: the first rank gets one extra row
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * (r + 1)
    out = rt.reducescatter(x, op=rt.Sum)
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    full = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) * sum(range(1, n + 1))
    torch.testing.assert_close(out, full[start : start + counts[r]])
    avg = rt.reducescatter(torch.ones(n * 2, 3))
    torch.testing.assert_close(avg, torch.ones(2, 3))
    outs = rt.grouped_reducescatter([torch.ones(n, 1), torch.ones(n, 2)], op=rt.Sum)
    assert outs[1].shape == (1, 2) and outs[1].sum().item() == 2 * n
    # autograd, as Horovod: Sum's gradient is the allgathered slices times the set size
    x = torch.ones(n, 2, requires_grad=True)
    rt.reducescatter(x, op=rt.Sum).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((n, 2), float(n)))
    # Large enough to go around ringtrain's ring in segments (chunks of several MiB), 1-D and
    # with uneven rows, every reduce op; integer values, so every summation order is exact.
    rows = (3 << 20) * n // 2 + 1
    x = torch.arange(rows, dtype=torch.float64) % 7 + r
    counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
    start = sum(counts[:r])
    every = torch.stack([torch.arange(rows, dtype=torch.float64) % 7 + k for k in range(n)])
    mine = slice(start, start + counts[r])
    for op, want in (
        (rt.Sum, every.sum(0)),
        (rt.Average, every.mean(0)),
        (rt.Min, every.amin(0)),
        (rt.Max, every.amax(0)),
        (rt.Product, every.prod(0)),
    ):
        torch.testing.assert_close(rt.reducescatter(x, op=op), want[mine], rtol=0, atol=0)


def test_reducescatter(world: World) -> None:
    world.run(_reducescatter)


def _alltoall() -> None:
    r, n = rt.rank(), rt.size()
    # rank r sends k+1 rows to rank k, each row tagged with (sender, receiver)
    splits = [k + 1 for k in range(n)]
    rows = torch.cat([torch.tensor([[r, k]] * (k + 1)) for k in range(n)])
    out, received = rt.alltoall(rows, splits=splits)
    assert received.tolist() == [r + 1] * n
    expected = torch.cat([torch.tensor([[s, r]] * (r + 1)) for s in range(n)])
    assert torch.equal(out, expected)
    even = rt.alltoall(torch.arange(n) + 10 * r)
    assert even.tolist() == [10 * s + r for s in range(n)]
    x = torch.ones(n, 2, requires_grad=True)
    rt.alltoall(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(n, 2))


def test_alltoall(world: World) -> None:
    world.run(_alltoall)


def _bad_splits() -> None:
    rt.alltoall(torch.ones(5), splits=[1] * (rt.size() + 1))


def test_alltoall_bad_splits(world2: World) -> None:
    with pytest.raises(RankFailed, match="splits has 3 entries, expected one per rank"):
        world2.run(_bad_splits, timeout=30)


def _objects() -> None:
    r, n = rt.rank(), rt.size()
    obj = {"config": [1, 2, 3], "rank": r} if r == 0 else None
    assert rt.broadcast_object(obj, 0) == {"config": [1, 2, 3], "rank": 0}
    assert rt.allgather_object(("r", r)) == [("r", k) for k in range(n)]
    big = b"x" * (100_000 + r)  # larger than one control slot, different per rank
    assert [len(b) for b in rt.allgather_object(big)] == [100_000 + k for k in range(n)]


@PATHS
def test_objects(world: World, path: str) -> None:
    world.run(on(path, _objects))


def _broadcast_path() -> list[int]:
    counts = []
    for t in (torch.ones(3), torch.ones(inline.INLINE_MAX_BYTES // 4 + 1)):
        got, count = inline_ops(lambda t=t: rt.broadcast(t * rt.rank(), 0))
        assert torch.equal(got, torch.zeros_like(t))
        counts.append(count)
    return counts


def test_small_broadcasts_travel_in_the_negotiation(world2: World) -> None:
    for counts in world2.run(_broadcast_path):
        assert counts == [1, 0]


def _object_path() -> list[int]:
    obj = {"config": [1, 2, 3]} if rt.rank() == 0 else None
    got, broadcast = inline_ops(lambda: rt.broadcast_object(obj, 0))
    assert got == {"config": [1, 2, 3]}
    everyone, allgather = inline_ops(lambda: rt.allgather_object(("r", rt.rank())))
    assert everyone == [("r", k) for k in range(rt.size())]
    return [broadcast, allgather]


def test_small_objects_travel_in_the_negotiation(world2: World) -> None:
    # The allgather_object is two allgathers (the sizes, then the data): both ride inline.
    for counts in world2.run(_object_path):
        assert counts == [1, 2]


def _process_sets() -> None:
    r, n = rt.rank(), rt.size()
    wanted = rt.ProcessSet([k for k in range(n) if k % 2 == 0])
    # Not registered yet: None for size and rank, included() from its ranks (Horovod's answers).
    assert (wanted.size(), wanted.rank(), wanted.included()) == (None, None, r % 2 == 0)
    if n == 1:  # [0] is the global set's ranks: refused, as Horovod's add_process_set does
        with pytest.raises(ValueError, match="these are the ranks of the global process set"):
            rt.add_process_set(wanted)
        return
    evens = rt.add_process_set(wanted)
    assert evens.size() == len(evens.ranks)
    assert evens.process_set_id is not None
    if evens.included():
        out = rt.allreduce(torch.ones(1), op=rt.Sum, process_set=evens)
        assert out.item() == len(evens.ranks)
        assert evens.rank() == evens.ranks.index(r)
        assert rt.broadcast_object(r, 0, process_set=evens) == 0
    else:
        try:
            rt.allreduce(torch.ones(1), process_set=evens)
        except rt.CollectiveArgumentError as e:
            assert "not a member" in str(e)
        else:
            raise AssertionError("non-member allreduce was accepted")
        with pytest.raises(ValueError, match="not a member"):
            evens.rank()  # Horovod: "Process is not part of provided process set."
    rt.barrier()
    assert rt.remove_process_set(evens)
    assert rt.global_process_set.size() == n
    if n > 1:  # a set whose set ranks differ from the global ones: roots are global ranks
        tail = rt.add_process_set(list(range(1, n)))
        if tail.included():
            for root in tail.ranks:
                got = rt.broadcast(torch.tensor([float(r)]), root, process_set=tail)
                assert got.item() == root
                assert rt.broadcast_object(r, root, process_set=tail) == root
            rows = rt.allgather(torch.tensor([r]), process_set=tail)
            assert rows.tolist() == list(range(1, n))
        rt.barrier()
        assert rt.remove_process_set(tail)


@PATHS
def test_process_sets(world: World, path: str) -> None:
    world.run(on(path, _process_sets))


def _init_with_sets() -> list[int]:
    ps = rt.ProcessSet([0])
    rt.shutdown()
    rt.init(process_sets=[ps])
    out = rt.allreduce(torch.ones(1), op=rt.Sum, process_set=ps).item() if ps.included() else -1
    return [int(out)]


def test_init_with_process_sets(world2: World) -> None:
    assert world2.run(_init_with_sets) == [[1], [-1]]


def _queries_before_init() -> list[str]:
    # Horovod's global set (id 0) raises ValueError before init(); a set of ranks answers None.
    out = []
    for query in (rt.global_process_set.size, rt.global_process_set.rank):
        try:
            query()
        except ValueError as e:
            out.append(str(e).splitlines()[0])
    assert rt.ProcessSet([0, 1]).size() is None
    return out


def test_the_global_sets_queries_need_init_as_horovods_do(world2: World) -> None:
    for said in world2.run(_queries_before_init, init=False):
        assert len(said) == 2 and all("needs ringtrain to be initialized" in m for m in said)


def _join() -> int:
    r, n = rt.rank(), rt.size()
    # rank r has r+1 batches: ranks that run out join, the others keep reducing; as in Horovod,
    # the joined ranks add zeros (Average divides by every rank; tests/collectives/
    # test_horovod_semantics.py checks that and what is refused meanwhile)
    for step in range(r + 1):
        out = rt.allreduce(torch.ones(2) * (step + 1), op=rt.Sum, name=f"step{step}")
        active = n - step
        torch.testing.assert_close(out, torch.ones(2) * (step + 1) * active)
    return rt.join()


@PATHS
def test_join_uneven_batches(world: World, path: str) -> None:
    assert world.run(on(path, _join)) == [world.size - 1] * world.size


def _reinit() -> None:
    for _ in range(3):
        rt.shutdown()
        rt.init()
        assert rt.allreduce(torch.ones(1), op=rt.Sum).item() == rt.size()


def test_init_after_shutdown_repeatedly(world: World) -> None:
    world.run(_reinit)


def _sets_that_differ() -> dict[str, object]:
    # Rank 0 registers [0, 1], rank 1 [1]: before the ranks agreed, both got id 1 silently and
    # rank 0's allreduce on it waited out the transport's timeout, blaming rank 1's end.
    try:
        rt.add_process_set([0, 1] if rt.rank() == 0 else [1])
    except rt.ConfigError as e:
        error = str(e)
    else:
        error = ""
    agreed = rt.add_process_set([1])  # the same set on every rank: registered
    total = rt.allreduce(torch.ones(1), op=rt.Sum, process_set=agreed).item() if rt.rank() else 1
    return {"error": error, "id": agreed.process_set_id, "total": total}


def test_ranks_that_add_different_process_sets_fail_on_every_rank(world2: World) -> None:
    for res in world2.run(_sets_that_differ):
        assert res["error"] == (
            "add_process_set: the ranks gave different process sets:\n"
            "  rank(s) 0: [0, 1]\n  rank(s) 1: [1]\n"
            "HINT: every rank of the world calls add_process_set with the same ranks, in the "
            "same order of calls (members or not); nothing was registered."
        ), res
        assert res["id"] == 1 and res["total"] == 1.0, res
