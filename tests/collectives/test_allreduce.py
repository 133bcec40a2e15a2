"""allreduce in every variant, op, dtype and error case; rank-agnostic, run at sizes 1-3."""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

import ringtrain as rt
import ringtrain.torch as hvd
from _inline_paths import PATHS, inline_ops, on
from ringtrain.collectives import inline
from ringtrain.testing.spawn import RankFailed, World


def _ops() -> None:
    r, n = rt.rank(), rt.size()
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + r
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    ranks = torch.arange(n, dtype=torch.float32)
    torch.testing.assert_close(rt.allreduce(x), base + ranks.mean())
    torch.testing.assert_close(rt.allreduce(x, op=rt.Sum), base * n + ranks.sum())
    torch.testing.assert_close(rt.allreduce(x, op=rt.Min), base)
    torch.testing.assert_close(rt.allreduce(x, op=rt.Max), base + n - 1)
    p = torch.full((3,), float(r + 2))
    torch.testing.assert_close(
        rt.allreduce(p, op=rt.Product), torch.full((3,), float(torch.arange(2, n + 2).prod()))
    )
    torch.testing.assert_close(rt.allreduce(x, average=False), base * n + ranks.sum())
    # Horovod's hvd.Average, hvd.Sum, hvd.Min are the ints 0, 1, 3: a number means the same op.
    torch.testing.assert_close(hvd.allreduce(x, op=0), base + ranks.mean())
    torch.testing.assert_close(hvd.allreduce(x, op=1), base * n + ranks.sum())
    torch.testing.assert_close(hvd.allreduce(x, op=3), base)
    # scale factors: out = post * sum(pre * x)
    torch.testing.assert_close(
        rt.allreduce(x, op=rt.Sum, prescale_factor=2.0, postscale_factor=0.5),
        base * n + ranks.sum(),
    )


@PATHS
def test_reduce_ops(world: World, path: str) -> None:
    world.run(on(path, _ops))


def _variants() -> None:
    r, n = rt.rank(), rt.size()
    t = torch.ones(4) * (r + 1)
    expected_sum = torch.ones(4) * n * (n + 1) / 2
    out = rt.allreduce_(t, op=rt.Sum)
    assert out is t
    torch.testing.assert_close(t, expected_sum)
    h = rt.allreduce_async(torch.ones(4), op=rt.Sum, name="async.one")
    torch.testing.assert_close(rt.synchronize(h), torch.ones(4) * n)
    t2 = torch.ones(3)
    h = rt.allreduce_async_(t2, op=rt.Sum, name="async.inplace")
    assert rt.synchronize(h) is t2
    torch.testing.assert_close(t2, torch.ones(3) * n)
    outs = rt.grouped_allreduce([torch.ones(2), torch.ones(3) * 2], op=rt.Sum)
    torch.testing.assert_close(outs[1], torch.ones(3) * 2 * n)
    group = [torch.ones(2), torch.ones(5)]
    rt.grouped_allreduce_(group, op=rt.Sum)
    torch.testing.assert_close(group[1], torch.ones(5) * n)
    h = rt.grouped_allreduce_async([torch.ones(1)], op=rt.Sum)
    torch.testing.assert_close(rt.synchronize(h)[0], torch.ones(1) * n)
    # fp16 compression on the wire, result back in fp32
    y = rt.allreduce(torch.full((8,), 0.5), compression=rt.Compression.fp16)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, torch.full((8,), 0.5))


def test_variants(world: World) -> None:
    world.run(_variants)


def _out_of_order() -> None:
    """Ranks submit in different orders; names match them up, pending ops survive a barrier."""
    r = rt.rank()
    names = ["a", "b", "c", "d"]
    order = names if r % 2 == 0 else list(reversed(names))
    handles = {
        nm: rt.allreduce_async(torch.ones(2) * (i + 1), op=rt.Sum, name=nm)
        for nm, i in ((nm, names.index(nm)) for nm in order)
    }
    extra = rt.allreduce_async(torch.ones(1), op=rt.Sum, name="after-barrier")
    rt.barrier()
    for i, nm in enumerate(names):
        torch.testing.assert_close(rt.synchronize(handles[nm]), torch.ones(2) * (i + 1) * rt.size())
    assert rt.synchronize(extra).item() == rt.size()


def test_matched_by_name_not_order(world: World) -> None:
    world.run(_out_of_order)


def _poll_nonblocking() -> bool:
    # Only rank 0 submits at first: its handle must stay pending, and poll must return without
    # waiting for it, since the other ranks submit only after rank 0's "go" (a blocking poll
    # would hang here, and the harness's timeout would fail the test).
    if rt.rank() == 0:
        h = rt.allreduce_async(torch.ones(1), name="late")
        first = rt.poll(h)
        rt.broadcast_object("go", 0, name="go")
        rt.synchronize(h)
        return first if rt.size() > 1 else True
    rt.broadcast_object(None, 0, name="go")
    rt.synchronize(rt.allreduce_async(torch.ones(1), name="late"))
    return True


def test_poll_is_nonblocking(world: World) -> None:
    results = world.run(_poll_nonblocking)
    if world.size > 1:
        assert results[0] is False  # still waiting for the other ranks when polled


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
]


def _dtypes() -> None:
    n = rt.size()
    for dt in DTYPES:
        if dt == torch.bool:
            x = torch.tensor([True, False, rt.rank() == 0])
            out = rt.allreduce(x, op=rt.Max)
            assert out.dtype == torch.bool and out.tolist() == [True, False, True], out
            continue
        x = torch.ones(5, dtype=torch.float32).to(dt)
        out = rt.allreduce(x, op=rt.Sum, name=f"dtype.{dt}")
        assert out.dtype == dt, (dt, out.dtype)
        torch.testing.assert_close(
            out.to(torch.float64 if not dt.is_complex else torch.complex128),
            (torch.ones(5) * n).to(torch.float64 if not dt.is_complex else torch.complex128),
        )
    big = (
        torch.tensor([2**63 + 5], dtype=torch.uint64)
        if n == 1
        else torch.tensor([2**62], dtype=torch.uint64)
    )
    rt.allreduce(big, op=rt.Sum)


@PATHS
def test_every_dtype(world: World, path: str) -> None:
    world.run(on(path, _dtypes))


def _bool_reductions() -> list[str]:
    """bool reduces as torch's elementwise bool ops; an Average or a scale factor has no bool
    meaning (it gave a logical or) and is refused on every rank, which then go on."""
    n = rt.size()
    x = torch.tensor([True, False, rt.rank() == 0])
    assert hvd.allreduce(x, op=hvd.Sum).tolist() == [True, False, True]
    assert hvd.allreduce(x, op=hvd.Min).tolist() == [True, False, n == 1]
    assert hvd.allreduce(x, op=hvd.Product).tolist() == [True, False, n == 1]
    said = []
    for call in (
        lambda: hvd.allreduce(x),  # Horovod's default op: Average
        lambda: hvd.allreduce(x, op=hvd.Sum, postscale_factor=0.5),
        lambda: hvd.reducescatter(torch.ones(2 * n, dtype=torch.bool)),
    ):
        try:
            call()
        except ValueError as e:
            said.append(str(e))
        else:
            said.append("no error")
        assert rt.allreduce(torch.ones(1), op=rt.Sum).item() == n
    return said


def test_bool_average_is_refused(world2: World) -> None:
    for said in world2.run(_bool_reductions, timeout=60):
        assert "Average is not defined for torch.bool" in said[0] and "HINT" in said[0], said
        assert "cannot be scaled (prescale_factor=1.0, postscale_factor=0.5)" in said[1], said
        assert "Average is not defined for torch.bool" in said[2], said


def _which_path() -> list[int]:
    counts = []
    for t, op in [
        (torch.ones(4), rt.Sum),  # 16 bytes: inline
        (torch.ones(inline.INLINE_MAX_BYTES // 4 + 1), rt.Sum),  # just too big: a collective
        (torch.ones(3, dtype=torch.int16) * (rt.rank() + 1), rt.Average),  # widened: inline
    ]:
        out, count = inline_ops(lambda t=t, op=op: rt.allreduce(t, op=op))
        assert out.dtype == t.dtype
        counts.append(count)
    pair = [torch.ones(2), torch.ones(2, dtype=torch.float64)]  # two reduction dtypes
    mixed, count = inline_ops(lambda: rt.grouped_allreduce(pair, op=rt.Sum))
    assert [m.tolist() for m in mixed] == [[rt.size()] * 2] * 2
    return [*counts, count]


def test_small_allreduces_travel_in_the_negotiation(world2: World) -> None:
    for counts in world2.run(_which_path):
        assert counts == [1, 0, 1, 0]


def _mismatch(kind: str) -> None:
    r = rt.rank()
    if kind == "shape":
        rt.allreduce(torch.ones(3 + r), name="bad.shape")
    elif kind == "dtype":
        rt.allreduce(
            torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64), name="bad.dtype"
        )
    elif kind == "op":
        rt.allreduce(torch.ones(3), op=rt.Sum if r == 0 else rt.Max, name="bad.op")
    elif kind == "type":
        rt.allreduce([1, 2, 3], name="bad.type")  # type: ignore[arg-type]
    elif kind == "adasum":
        rt.allreduce(torch.ones(1), op=rt.Adasum)


@pytest.mark.parametrize("kind", ["shape", "dtype", "op"])
def test_mismatch_raises_on_every_rank(world3: World, kind: str) -> None:
    with pytest.raises(RankFailed) as info:
        world3.run(_mismatch, kind, timeout=30)
    msg = str(info.value)
    for r in range(3):
        assert f"--- rank {r} ---\nCollectiveMismatchError" in msg, msg
    assert "differs" in msg and "HINT" in msg


def test_wrong_type_raises_everywhere(world2: World) -> None:
    with pytest.raises(RankFailed) as info:
        world2.run(_mismatch, "type", timeout=30)
    msg = str(info.value)
    for r in range(2):
        assert (
            f"--- rank {r} ---\nCollectiveArgumentError: collective 'bad.type' was invalid" in msg
        ), msg
    assert "expects a torch.Tensor, got list" in msg


def test_adasum_is_rejected_clearly(world2: World) -> None:
    with pytest.raises(RankFailed, match="Adasum is not supported"):
        world2.run(_mismatch, "adasum", timeout=30)


def _duplicate_name() -> None:
    if rt.size() == 1:
        # Alone, the first op may finish before the second is submitted; only a duplicate of an
        # op that is still pending must be refused, so retry until the race is lost.
        for _ in range(50):
            h = rt.allreduce_async(torch.ones(1), name="dup")
            try:
                h2 = rt.allreduce_async(torch.ones(1), name="dup")
            except rt.CollectiveArgumentError as e:
                assert "already in flight" in str(e)
                rt.synchronize(h)
                return
            # Accepted: the first had already finished, so this was no duplicate.
            rt.synchronize(h2)
            rt.synchronize(h)
        raise AssertionError("the first op always finished before the duplicate was submitted")
    # With peers, "dup" cannot finish before they submit it: they wait until rank 0 has tried the
    # duplicate (a file is the signal, so no collective of the test's own is in flight meanwhile).
    flag = Path(tempfile.gettempdir()) / f"rt-dup-{rt.broadcast_object(uuid.uuid4().hex)}"
    if rt.rank() == 0:
        h = rt.allreduce_async(torch.ones(1), name="dup")
        with pytest.raises(rt.CollectiveArgumentError, match="already in flight"):
            rt.allreduce_async(torch.ones(1), name="dup")
        flag.touch()
        rt.synchronize(h)
    else:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert time.monotonic() < deadline, "rank 0 never tried the duplicate"
            time.sleep(0.01)
        rt.allreduce(torch.ones(1), name="dup")
    rt.barrier()
    if rt.rank() == 0:
        flag.unlink()


def test_duplicate_name_in_flight(world: World) -> None:
    world.run(_duplicate_name)


def _autograd() -> None:
    n = rt.size()
    x = torch.ones(3, requires_grad=True)
    y = rt.allreduce(x * (rt.rank() + 1), op=rt.Sum)
    y.sum().backward()
    # d/dx of sum_r (r+1) x_r, gradients allreduced with Sum: each rank gets n * (rank+1)
    torch.testing.assert_close(x.grad, torch.full((3,), float(n * (rt.rank() + 1))))


def test_autograd(world: World) -> None:
    world.run(_autograd)


def _inline_mismatch_unchecked() -> list[str]:
    messages = []
    for op in (
        lambda: rt.allreduce(torch.ones(2 + rt.rank()), name="unchecked.shape"),
        lambda: rt.allgather(torch.ones(1, 2 + rt.rank()), name="unchecked.rows"),
    ):
        try:
            op()
        except rt.CollectiveMismatchError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


def test_inline_shape_mismatch_without_checks_fails_cleanly(world2: World) -> None:
    # With consistency checks off nothing compares shapes first: the inline path itself must
    # refuse, on every rank, and the controller must live on.
    for reduced, gathered in world2.run(_inline_mismatch_unchecked, check_consistency=False):
        assert "different sizes" in reduced and "unchecked.shape" in reduced, reduced
        assert "different sizes" in gathered and "unchecked.rows" in gathered, gathered
    world2.run(_ops)


def _sparse() -> None:
    r, n = rt.rank(), rt.size()
    dense = _rank_dense(r)  # rows overlap on 0 and differ elsewhere
    h = hvd.sparse_allreduce_async(dense.to_sparse(), name="sparse.avg", op=rt.Average)
    assert isinstance(rt.poll(h), bool)
    got = rt.synchronize(h)
    assert got.is_sparse and got.shape == dense.shape
    expected = sum(_rank_dense(k) for k in range(n)) / n
    torch.testing.assert_close(got.to_dense(), expected)
    total = rt.synchronize(hvd.sparse_allreduce_async(dense.to_sparse(), "sparse.sum", rt.Sum))
    torch.testing.assert_close(total.to_dense(), expected * n)


def _rank_dense(k: int) -> torch.Tensor:
    """Rank k's tensor: 1 in row 0, plus k+1 in row k % 4."""
    d = torch.zeros(4, 2)
    d[0] = 1.0
    d[k % 4] += k + 1
    return d


def test_sparse_allreduce_async(world: World) -> None:
    world.run(_sparse)


def _sparse_bad() -> None:
    with pytest.raises(rt.CollectiveArgumentError, match="sparse COO tensor"):
        hvd.sparse_allreduce_async(torch.ones(3), "bad.dense")
    with pytest.raises(rt.CollectiveArgumentError, match="Average and Sum"):
        hvd.sparse_allreduce_async(torch.ones(3).to_sparse(), "bad.op", op=rt.Max)


def test_sparse_allreduce_rejects_what_it_cannot_do(world2: World) -> None:
    world2.run(_sparse_bad)
