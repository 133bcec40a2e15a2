"""Secure mode gives the same results as plain mode: every collective, op and dtype.

Each rank function runs twice on the same ranks, plainly and sealed, and returns what it got;
the test compares rank by rank. At two ranks a ring sums in the same order as Gloo, so results
are exact; at three, float sums may round differently (stated tolerance).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ringtrain as rt
from ringtrain.testing.spawn import World

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
]


def _inputs(dtype: torch.dtype, r: int, numel: int = 37) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + r)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(0, 5, (numel,), generator=g).to(dtype)


def _collectives() -> dict[str, Any]:
    r, n = rt.rank(), rt.size()
    out: dict[str, Any] = {}
    for dt in DTYPES:
        for op in (rt.Sum, rt.Average, rt.Min, rt.Max):
            out[f"allreduce.{dt}.{op}"] = rt.allreduce(_inputs(dt, r), op=op)
        small = (_inputs(dt, r, 5).abs() % 3 + 1).to(dt)
        out[f"product.{dt}"] = rt.allreduce(small, op=rt.Product)
    # fused: several small tensors in one buffer (one direct allgather); one large tensor (the
    # ring, several sealed segments)
    out["grouped"] = rt.grouped_allreduce([_inputs(torch.float32, r, k) for k in (1, 3, 1000)])
    big = torch.randn(700_000, generator=torch.Generator().manual_seed(r))
    out["big"] = rt.allreduce(big, op=rt.Sum)
    # medium: direct reduce-scatter and allgather rounds, but not a whole-tensor allgather
    medium = torch.randn(300_000, generator=torch.Generator().manual_seed(10 + r))
    out["medium"] = rt.allreduce(medium, op=rt.Average)
    # small exchanges take one direct round, larger ones the ring
    out["allgather.big"] = rt.allgather(
        torch.randn(300_000, generator=torch.Generator().manual_seed(r))
    )
    # uneven allgather: rank r contributes r + 1 rows
    out["allgather"] = rt.allgather(torch.full((r + 1, 3), r, dtype=torch.int16))
    out["allgather.bf16"] = rt.allgather(_inputs(torch.bfloat16, r, 4).reshape(2, 2))
    out["broadcast"] = rt.broadcast(_inputs(torch.float16, r), root_rank=n - 1)
    out["broadcast.bool"] = rt.broadcast(torch.tensor([r % 2 == 0, True]), root_rank=0)
    out["reducescatter"] = rt.reducescatter(
        torch.arange((2 * n + 1) * 2, dtype=torch.float32).reshape(-1, 2) * (r + 1), op=rt.Sum
    )
    splits = [(r + k) % 3 for k in range(n)]
    rows = torch.arange(sum(splits) * 2, dtype=torch.int64).reshape(-1, 2) + 100 * r
    got, recv = rt.alltoall(rows, splits=torch.tensor(splits))
    out["alltoall"], out["alltoall.splits"] = got, recv
    out["broadcast_object"] = rt.broadcast_object({"from": r, "list": [1, 2, r]}, root_rank=0)
    out["allgather_object"] = rt.allgather_object(("rank", r, "x" * r))
    rt.barrier()
    return out


def _compare(plain: list[dict[str, Any]], sealed: list[dict[str, Any]], exact: bool) -> None:
    for p, s in zip(plain, sealed):
        assert p.keys() == s.keys()
        for name in p:
            a, b = p[name], s[name]
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape, name
                if exact or not a.is_floating_point():
                    assert torch.equal(a, b), name
                else:
                    tol = 1e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-5
                    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
            elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
                for x, y in zip(a, b):
                    torch.testing.assert_close(x, y, msg=name)
            else:
                assert a == b, name


@pytest.mark.parametrize("size", [2, 3])
def test_sealed_matches_plain(size: int, key_file: str) -> None:
    from ringtrain.testing import spawn

    world: World = spawn.world(size)
    plain = world.run(_collectives, timeout=90)
    sealed = world.run(_collectives, timeout=90, secure=True, key_file=key_file)
    _compare(plain, sealed, exact=size == 2)


def _uses_sealed_groups() -> list[str]:
    import torch.distributed as dist

    from ringtrain.runtime import state

    comm = state.current().world.communicator
    return [str(dist.get_backend(comm.group(k))) for k in ("control", "cpu", "engine")]


def test_every_group_is_sealed(world2: World, key_file: str) -> None:
    names = world2.run(_uses_sealed_groups, secure=True, key_file=key_file)
    assert names == [["ringtrain_sealed"] * 3] * 2
    assert world2.run(_uses_sealed_groups) == [["gloo"] * 3] * 2


def _process_set() -> list[float]:
    # Ranks 0 and 1, or in a world of 2 (the enclave jobs) rank 1 alone: a set of the whole
    # world is refused, as Horovod refuses it.
    members = [0, 1] if rt.size() > 2 else [rt.size() - 1]
    ps = rt.add_process_set(members)
    try:
        if rt.rank() in members:
            return rt.allreduce(torch.ones(2) * rt.rank(), op=rt.Sum, process_set=ps).tolist()
        return []
    finally:
        rt.remove_process_set(ps)


def test_process_set_sealed(world3: World, key_file: str) -> None:
    got = world3.run(_process_set, secure=True, key_file=key_file)
    assert got == [[1.0, 1.0], [1.0, 1.0], []]


def _uneven_all_gather() -> list[torch.Tensor]:
    import torch.distributed as dist

    # Only rank 0's piece is large: every rank must still pick the same algorithm (direct round
    # or ring), though the bytes each one receives differ.
    sizes = [300_000] + [1000] * (rt.size() - 1)
    outs = [torch.empty(k) for k in sizes]
    dist.all_gather(outs, torch.full((sizes[rt.rank()],), float(rt.rank())))
    return outs


def test_uneven_all_gather_on_the_sealed_group(world3: World, key_file: str) -> None:
    for outs in world3.run(_uneven_all_gather, secure=True, key_file=key_file, timeout=60):
        assert [t.numel() for t in outs] == [300_000, 1000, 1000]
        assert all(torch.equal(t, torch.full_like(t, float(i))) for i, t in enumerate(outs))
