"""Gradients of every differentiable collective, as Horovod defines them, at 2 and 4 ranks.

The expected gradients are written from Horovod's definitions (horovod/torch/mpi_ops.py, the
backward of each autograd Function), with every rank's upstream gradient known to all: rank k's
loss is ``sum(output * w(k))``, so the gradient arriving at rank k is ``w(k)``. With n members in
the set, p this rank's position in it and ``W = [w(k) for k in members]``:

* allreduce: ``allreduce(W)`` with the forward's op and scale factors;
* allgather: ``mean(W)``, rows of this rank only;
* broadcast: ``mean(W)`` on the root, zeros elsewhere;
* reducescatter: ``cat(W) * pre * post``, times n for Sum;
* alltoall: each block back to the rank it came from.

Every case runs on the global set and on process sets of two members, {1, 3} and {0, 2} at four
ranks, in one spawned world per size. float64 with small halves keeps the sums exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives import inline
from ringtrain.testing import spawn

F64 = torch.float64


def _w(k: int, shape: Sequence[int], dtype: torch.dtype = F64) -> torch.Tensor:
    """Rank k's upstream gradient: distinct per rank and per element, exact in fp16 too."""
    numel = math.prod(shape)
    return (torch.arange(numel, dtype=dtype).reshape(tuple(shape)) * 0.5 + 10 * (k + 1)).to(dtype)


def _backward(outs: Sequence[torch.Tensor], ws: Sequence[torch.Tensor]) -> None:
    sum((o * w).sum() for o, w in zip(outs, ws)).backward()  # type: ignore[union-attr]


def _close(got: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
    assert got is not None, f"{what}: no gradient"
    torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _leaf(shape: Sequence[int], value: float, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.full(tuple(shape), value, dtype=dtype, requires_grad=True)


def _allreduce(ps: rt.ProcessSet | None, members: list[int]) -> None:
    r = rt.rank()
    n = len(members)
    W = torch.stack([_w(k, (2, 3)) for k in members])
    cases = [
        # (op, average, pre, post, expected)
        (rt.Sum, None, 1.0, 1.0, W.sum(0)),
        (rt.Average, None, 1.0, 1.0, W.sum(0) / n),
        (None, None, 1.0, 1.0, W.sum(0) / n),  # the default op: Average
        (None, False, 1.0, 1.0, W.sum(0)),  # the deprecated average=False: Sum
        (rt.Sum, None, 0.5, 3.0, W.sum(0) * 1.5),
        (rt.Average, None, 2.0, 0.25, W.sum(0) / n * 0.5),
        (rt.Min, None, 1.0, 2.0, W.min(0).values * 2),
        (rt.Max, None, 4.0, 1.0, W.max(0).values * 4),
    ]
    for op, average, pre, post, expected in cases:
        x = _leaf((2, 3), r + 1.0)
        y = rt.allreduce(
            x, average, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
        )
        _backward([y], [_w(r, (2, 3))])
        _close(x.grad, expected, f"allreduce op={op} average={average} pre={pre} post={post}")

    # fp16 compression: the gradient crosses the wire in fp16 too, and comes back as float32
    x = _leaf((2, 3), 1.0, torch.float32)
    y = rt.allreduce(x, op=rt.Sum, compression=rt.Compression.fp16, process_set=ps, name="ar.c")
    assert y.dtype == torch.float32
    _backward([y], [_w(r, (2, 3), torch.float32)])
    _close(x.grad, W.sum(0).float(), "allreduce fp16")

    # grouped: each tensor as its own allreduce; a member without grad rides along
    for op, pre, post, scale in ((rt.Sum, 2.0, 0.5, 1.0), (rt.Average, 1.0, 3.0, 3.0 / n)):
        a, b = _leaf((2,), 1.0), _leaf((3, 2), 2.0)
        frozen = torch.ones(4, dtype=F64)
        outs = rt.grouped_allreduce(
            [a, frozen, b],
            op=op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=ps,
            name=f"gar.{op}",
        )
        assert [o.shape for o in outs] == [(2,), (4,), (3, 2)]
        _backward([outs[0], outs[2]], [_w(r, (2,)), _w(r, (3, 2))])
        _close(a.grad, sum(_w(k, (2,)) for k in members) * scale, f"grouped_allreduce {op} a")
        _close(b.grad, sum(_w(k, (3, 2)) for k in members) * scale, f"grouped_allreduce {op} b")

    # torch's own check: with every rank perturbing the same element at once, Sum's Jacobian
    # is pre*post*n and Average's pre*post, which is what the gradient allreduce computes.
    for op in (rt.Sum, rt.Average):
        x = torch.arange(3, dtype=F64, requires_grad=True)
        assert torch.autograd.gradcheck(
            lambda t, op=op: rt.allreduce(
                t, op=op, prescale_factor=0.5, postscale_factor=3.0, process_set=ps
            ),
            (x,),
        )
        pair = (torch.ones(2, dtype=F64, requires_grad=True), torch.ones(1, dtype=F64) * r)
        assert torch.autograd.gradcheck(
            lambda s, t, op=op: tuple(rt.grouped_allreduce([s, t], op=op, process_set=ps)),
            (pair[0], pair[1].requires_grad_()),
        )


def _allgather(ps: rt.ProcessSet | None, members: list[int]) -> None:
    r, n, p = rt.rank(), len(members), members.index(rt.rank())
    rows = [k + 1 for k in range(n)]  # position k contributes k+1 rows
    total, start = sum(rows), sum(rows[:p])

    def mean(shape: Sequence[int]) -> torch.Tensor:
        return sum(_w(k, shape) for k in members) / n  # type: ignore[return-value]

    x = _leaf((rows[p], 2), float(r))
    y = rt.allgather(x, process_set=ps)
    assert y.shape == (total, 2)
    _backward([y], [_w(r, (total, 2))])
    _close(x.grad, mean((total, 2))[start : start + rows[p]], "allgather")

    # a 0-d tensor made one row (Horovod refuses a 0-d one): its gradient is 0-d again
    s = torch.tensor(float(r), dtype=F64, requires_grad=True)
    _backward([rt.allgather(s.reshape(1), process_set=ps, name="ag.scalar")], [_w(r, (n,))])
    _close(s.grad, mean((n,))[p], "allgather 0-d")

    a, b = _leaf((rows[p], 2), 1.0), _leaf((2,), 2.0)
    outs = rt.grouped_allgather([a, b], process_set=ps, name="gag")
    assert [o.shape for o in outs] == [(total, 2), (2 * n,)]
    _backward(outs, [_w(r, (total, 2)), _w(r, (2 * n,))])
    _close(a.grad, mean((total, 2))[start : start + rows[p]], "grouped_allgather a")
    _close(b.grad, mean((2 * n,))[2 * p : 2 * p + 2], "grouped_allgather b")


def _broadcast(ps: rt.ProcessSet | None, members: list[int], roots: list[int]) -> None:
    r, n = rt.rank(), len(members)
    for root in roots:
        x = _leaf((3,), float(r))
        y = rt.broadcast(x, root, process_set=ps)
        torch.testing.assert_close(y.detach(), torch.full((3,), float(root), dtype=F64))
        _backward([y], [_w(r, (3,))])
        expected = sum(_w(k, (3,)) for k in members) / n if r == root else torch.zeros(3, dtype=F64)
        _close(x.grad, expected, f"broadcast root={root}")  # type: ignore[arg-type]


def _reducescatter(ps: rt.ProcessSet | None, members: list[int]) -> None:
    r, n, p = rt.rank(), len(members), members.index(rt.rank())
    R = 2 * n + 1  # uneven: the first R % n positions get one row more
    counts = [R // n + (1 if k < R % n else 0) for k in range(n)]
    full = torch.cat([_w(m, (c, 2)) for m, c in zip(members, counts)])
    cases = [
        (rt.Sum, 1.0, 1.0, n),
        (rt.Average, 1.0, 1.0, 1),
        (None, 1.0, 1.0, 1),  # the default op: Average
        (rt.Sum, 0.5, 4.0, 2 * n),
        (rt.Average, 2.0, 0.25, 0.5),
    ]
    for op, pre, post, scale in cases:
        x = _leaf((R, 2), float(r))
        y = rt.reducescatter(x, op=op, process_set=ps, prescale_factor=pre, postscale_factor=post)
        assert y.shape == (counts[p], 2)
        _backward([y], [_w(r, (counts[p], 2))])
        _close(x.grad, full * scale, f"reducescatter op={op} pre={pre} post={post}")

    # fp16 compression, grouped too: the gradient comes back in the input's dtype
    x = _leaf((R, 2), 1.0, torch.float32)
    (y,) = rt.grouped_reducescatter([x], None, rt.Compression.fp16, rt.Sum, ps)
    assert y.dtype == torch.float32
    _backward([y], [_w(r, (counts[p], 2), torch.float32)])
    _close(x.grad, full.float() * n, "grouped_reducescatter fp16")

    for op, scale in ((rt.Sum, 3.0 * n), (rt.Average, 3.0)):
        a, b = _leaf((R, 2), 1.0), _leaf((n,), 1.0)
        outs = rt.grouped_reducescatter(
            [a, b], op=op, process_set=ps, prescale_factor=3.0, name=f"grs.{op}"
        )
        _backward(outs, [_w(r, (counts[p], 2)), _w(r, (1,))])
        _close(a.grad, full * scale, f"grouped_reducescatter {op} a")
        _close(b.grad, torch.cat([_w(m, (1,)) for m in members]) * scale, f"grouped rs {op} b")


def _alltoall(ps: rt.ProcessSet | None, members: list[int]) -> None:
    r, n, p = rt.rank(), len(members), members.index(rt.rank())

    def expected(splits: list[list[int]]) -> torch.Tensor:
        # splits[i][j]: rows position i sends to position j. Position j's output is its
        # receipts in sender order; our block in it starts after the senders before us.
        blocks = []
        for j, m in enumerate(members):
            received = sum(splits[i][j] for i in range(n))
            start = sum(splits[i][j] for i in range(p))
            blocks.append(_w(m, (received, 2))[start : start + splits[p][j]])
        return torch.cat(blocks)

    # explicit splits, zeros included, given as a list and as a tensor
    splits = [[(i + j) % 3 for j in range(n)] for i in range(n)]
    for given in (splits[p], torch.tensor(splits[p], dtype=torch.int32)):
        x = _leaf((sum(splits[p]), 2), float(r))
        out, received = rt.alltoall(x, splits=given, process_set=ps)
        assert received.tolist() == [splits[i][p] for i in range(n)]
        assert not received.requires_grad
        _backward([out], [_w(r, (int(received.sum()), 2))])
        _close(x.grad, expected(splits), f"alltoall splits={given!r}")

    # without splits each rank splits its own rows evenly, and the row counts differ per rank:
    # the gradient must go back along what was received, not an even split of it
    even = [[i + 1] * n for i in range(n)]
    x = _leaf((n * (p + 1), 2), float(r))
    out = rt.alltoall(x, process_set=ps, name="a2a.even")
    assert out.shape == (sum(i + 1 for i in range(n)), 2)
    _backward([out], [_w(r, (out.shape[0], 2))])
    _close(x.grad, expected(even), "alltoall without splits")


def _all_cases(ps: rt.ProcessSet | None, members: list[int], roots: list[int]) -> None:
    _allreduce(ps, members)
    _allgather(ps, members)
    _broadcast(ps, members, roots)
    _reducescatter(ps, members)
    _alltoall(ps, members)


def _grads(inline_max_bytes: int) -> int:
    # 0: every collective runs as a Gloo op of its own instead of inside the negotiation
    saved, inline.INLINE_MAX_BYTES = inline.INLINE_MAX_BYTES, inline_max_bytes
    try:
        return _grads_on_every_set()
    finally:
        inline.INLINE_MAX_BYTES = saved


def _grads_on_every_set() -> int:
    n = rt.size()
    _all_cases(None, list(range(n)), list(range(n)))
    sets = [[1, 3], [0, 2]] if n == 4 else [[0], [1]]  # never the world's: the global set's
    added = [rt.add_process_set(s) for s in sets]
    checked = 0
    for ps in added:
        if ps.included():
            # Roots are global ranks, as in Horovod: every member, {1, 3} too.
            roots = list(ps.ranks)
            _all_cases(ps, ps.ranks, roots)
            checked += 1
    rt.barrier()
    for ps in added:
        assert rt.remove_process_set(ps)
    return checked


@pytest.mark.parametrize(
    ("size", "path"), [(2, "inline"), (4, "inline"), (4, "collective")], ids=str
)
def test_gradients_as_horovod(size: int, path: str) -> None:
    limit = inline.INLINE_MAX_BYTES if path == "inline" else 0
    assert spawn.world(size).run(_grads, limit, timeout=240) == [1] * size


def _no_grad_mode() -> None:
    # under no_grad, or for tensors without grad, the grouped ops are plain collectives
    x = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        outs = rt.grouped_allreduce([x], op=rt.Sum)
    assert not outs[0].requires_grad and outs[0].tolist() == [float(rt.size())] * 2
    outs = rt.grouped_allgather([torch.ones(1)])
    assert not outs[0].requires_grad
    outs = rt.grouped_reducescatter([torch.ones(rt.size(), 2)], op=rt.Sum)
    assert outs[0].tolist() == [[float(rt.size())] * 2]


def test_no_grad_mode(world2: spawn.World) -> None:
    world2.run(_no_grad_mode)
