"""The collective path's copies run on the calling thread alone: no OpenMP team starts."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from ringtrain.collectives import copies


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch's intra-op threads at 2 (a 1-thread process would never start a team)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _threads_started(fn: Callable[[], object]) -> int:
    """How many threads ``fn`` leaves behind when run on a fresh thread (libgomp gives each
    thread that starts a parallel region its own team, kept for the next one)."""
    out: dict[str, int] = {}

    def body() -> None:
        before = set(os.listdir("/proc/self/task"))
        fn()
        out["new"] = len(set(os.listdir("/proc/self/task")) - before)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["new"]


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
def test_no_worker_threads(two_threads: None) -> None:
    src = torch.randn(4 << 20)  # 16 MiB
    dst = torch.empty_like(src)
    # The premise: torch's own copy of this size starts a team.
    assert _threads_started(lambda: dst.copy_(src)) >= 1
    assert _threads_started(lambda: copies.copy_(dst, src)) == 0
    assert _threads_started(lambda: copies.copy_all_([dst[:7], dst[7:]], [src[:7], src[7:]])) == 0
    assert _threads_started(lambda: copies.scale_(dst, 0.5)) == 0
    half = src.to(torch.bfloat16)
    assert _threads_started(lambda: copies.copy_(dst, half)) == 0  # a conversion, in pieces


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.bool]
)
@pytest.mark.parametrize("numel", [0, 5, copies.GRAIN, copies.GRAIN * 3 + 7])
def test_copies_are_exact(dtype: torch.dtype, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    top = 2 if dtype == torch.bool else 256  # a bool's byte is 0 or 1
    raw = torch.randint(0, top, ((numel + 3) * 8,), dtype=torch.uint8, generator=gen)
    width = torch.empty((), dtype=dtype).element_size()
    src = raw[: (numel + 1) * width].view(dtype)[1:]  # odd offset: no 8-byte words
    dst = torch.empty(numel + 1, dtype=dtype)[1:]
    copies.copy_(dst, src)
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
    whole = torch.empty(numel, dtype=dtype)
    copies.copy_all_([whole], [src])
    assert torch.equal(whole.view(torch.uint8), src.view(torch.uint8))
    if dtype.is_floating_point:
        expect = src.clone()
        expect.mul_(0.25)
        copies.scale_(whole, 0.25)
        assert torch.equal(whole.view(torch.uint8), expect.view(torch.uint8))


@pytest.mark.timeout(60)
def test_conversion_and_strided() -> None:
    src = torch.randn(copies.GRAIN * 2 + 1)
    dst = torch.empty(src.numel(), dtype=torch.float16)
    copies.copy_(dst, src)
    assert torch.equal(dst, src.to(torch.float16))
    grid = torch.randn(300, 300)
    out = torch.empty(300, 300)
    copies.copy_(out, grid.t())  # not one dense block: torch's own copy
    assert torch.equal(out, grid.t())
    ints = torch.arange(-75, copies.GRAIN * 2, dtype=torch.int32)
    copies.scale_(ints, 0.5)
    assert int(ints[0]) == -37  # through doubles, truncated (averaging.scale)
