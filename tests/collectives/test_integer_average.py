"""An integer ``Average`` is Horovod's: the sum times ``postscale / size`` in double precision,
truncated toward zero (horovod/common/ops/collective_operations.h ``ScaleBufferCPUImpl``, with
``postscale_factor /= size`` in gloo_operations.cc), whether or not a rank has joined: -75 / 2
gives -37, not -38 (issue 27). At 2 and 4 ranks, small (inline) and large (fused) tensors,
grouped, with a postscale factor, and reducescatter. int8 and uint8 too, though Horovod refuses
them (docs/horovod.md): summed wide, so an Average whose sum overflows the dtype is still right.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch

import ringtrain.torch as hvd
from ringtrain.collectives import inline
from ringtrain.testing import spawn

INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
pytestmark = pytest.mark.timeout(300)  # a 4-rank world on a busy 2-core machine
BIG = inline.INLINE_MAX_BYTES + 1  # elements: past what travels inline, whatever the dtype


@pytest.fixture(params=[2, 4], ids=lambda n: f"np{n}")
def world(request: pytest.FixtureRequest) -> spawn.World:
    return spawn.world(request.param)


@pytest.fixture(scope="module", autouse=True)
def _free_the_4_rank_world() -> Iterator[None]:
    yield
    spawn.close(4)


def horovod_average(total: int, size: int, postscale: float = 1.0) -> int:
    """What Horovod's Gloo path computes: ``(T)(total * (postscale / size))``."""
    return math.trunc(total * (postscale / size))


def _values(dtype: torch.dtype) -> list[int]:
    """Rank 0's values; every other rank sends zeros, so these are the sums."""
    if dtype == torch.uint8:
        return [75, 7, 1, 255]
    top = 100 if dtype == torch.int8 else 1000
    return [-75, 75, -7, 7, -1, 1, -top, top - 1]


def _wrapped(values: list[int], dtype: torch.dtype) -> list[int]:
    """``values`` cast to ``dtype`` as torch casts: modulo 2**bits where they do not fit."""
    wrapped: list[int] = torch.tensor(values, dtype=torch.int64).to(dtype).tolist()
    return wrapped


def _narrow_sums(dtype: torch.dtype, joined: int, check: Callable[..., None]) -> None:
    """Every rank that has not joined sends the same values, whose sum overflows the narrow
    types (int8's 100 + 100 wrapped to -56 and averaged to -28 before they were widened): the Average is each
    value times the share of ranks that sent it, as Horovod's; a Sum that does not fit wraps as
    torch's own arithmetic on the dtype."""
    n = hvd.size()
    vals = {torch.int8: [100, -100, 127, -128], torch.uint8: [200, 255, 128, 1]}.get(
        dtype, [30000, -30000, 32767, -32768]
    )
    mine = torch.tensor(vals, dtype=dtype)
    want = [horovod_average(v * joined, n) for v in vals]
    check(f"{dtype} overflowing", hvd.allreduce(mine, name=f"o.{dtype}"), want)
    big = mine.repeat(BIG // len(vals) + 1)
    got = hvd.allreduce(big, name=f"ob.{dtype}")
    check(f"{dtype} overflowing big", got, want * (BIG // len(vals) + 1))
    got = hvd.allreduce(mine, name=f"os.{dtype}", op=hvd.Sum)
    check(f"{dtype} overflowing Sum", got, _wrapped([v * joined for v in vals], dtype))


def _averages(joined: int) -> list[str]:
    """Every case, on every rank that has not joined; ranks from ``joined`` up join first.
    Returns what differed from Horovod."""
    r, n = hvd.rank(), hvd.size()
    if r >= joined:
        hvd.join()
        return []
    bad: list[str] = []

    def check(what: str, got: torch.Tensor, want: list[int]) -> None:
        if got.tolist() != want:
            bad.append(f"{what}: got {got.tolist()[:8]}, Horovod gives {want[:8]}")

    for dtype in INTS:
        vals = _values(dtype)
        mine = torch.tensor(vals if r == 0 else [0] * len(vals), dtype=dtype)
        want = [horovod_average(v, n) for v in vals]
        check(f"{dtype} small", hvd.allreduce(mine, name=f"s.{dtype}"), want)
        big = mine.repeat(BIG // len(vals) + 1)
        got = hvd.allreduce(big, name=f"b.{dtype}")
        check(f"{dtype} big", got, want * (BIG // len(vals) + 1))
        outs = hvd.grouped_allreduce([mine, mine.clone()], name=f"g.{dtype}")
        check(f"{dtype} grouped", outs[1], want)
        if dtype in (torch.int32, torch.int64):  # 3x would overflow the narrow types
            post = hvd.allreduce(mine, name=f"p.{dtype}", postscale_factor=3.0)
            check(f"{dtype} postscale 3", post, [horovod_average(v, n, 3.0) for v in vals])
        if dtype.itemsize <= 2:
            _narrow_sums(dtype, joined, check)
    if joined == n:  # reducescatter is refused while a rank has joined, as in Horovod
        rows = torch.tensor([[-75], [75]] * n if r == 0 else [[0], [0]] * n, dtype=torch.int32)
        got = hvd.reducescatter(rows, name="rs")
        check("reducescatter", got.flatten(), [horovod_average(v, n) for v in (-75, 75)])
        for dtype, top in ((torch.uint8, 200), (torch.int8, -100), (torch.int16, 30000)):
            rows = torch.full((2 * n, 1), top, dtype=dtype)
            got = hvd.reducescatter(rows, name=f"rs.{dtype}")
            check(f"{dtype} reducescatter", got.flatten(), [top, top])
            got = hvd.reducescatter(rows, name=f"rs.sum.{dtype}", op=hvd.Sum)
            check(f"{dtype} reducescatter Sum", got.flatten(), _wrapped([top * n] * 2, dtype))
    hvd.join()
    return bad


def test_integer_average_truncates_as_horovod(world: spawn.World) -> None:
    assert world.run(_averages, world.size) == [[]] * world.size


def test_integer_average_while_a_rank_has_joined(world: spawn.World) -> None:
    # the last rank joins at once; the others average with its zeros, divided by every rank
    assert world.run(_averages, world.size - 1) == [[]] * world.size
