"""Every transport against torch.distributed's own collectives, for every dtype both carry.

The transports (:func:`ringtrain.transport.of`): the ring on a Gloo group (``RingTransport``),
the sealed group's and the tcp group's own ring (``RingGroupTransport``, ``secure=True`` and
``transport="tcp"``), NCCL's collectives (``NcclTransport``), and the hierarchical allreduce
over the engine's group (``HierarchicalTransport``, ranks placed on two hosts as a, a, b and
a, b, a; its reduce-scatter reduces every chunk, which the checks of rank r's chunk allow). One persistent world of 3
ranks (chunks of unequal sizes, an empty one, sums of three where order matters), one call per
kind of group. The reference is ``torch.distributed`` on a plain Gloo group made for the check
(``all_reduce``, ``reduce_scatter_tensor``, ``all_gather_into_tensor``), over the same inputs:

* ``allreduce``: equals ``all_reduce``'s result (the sealed and tcp groups sum around their own
  ring, so random floats within the bound below);
* ``reduce_scatter``: rank r's chunk r equals chunk r of ``all_reduce`` (chunks of unequal
  sizes, one empty) and ``reduce_scatter_tensor``'s output (equal chunks);
* ``allgather``: every chunk i equals rank i's, as ``all_gather_into_tensor`` gathers them;
* ``broadcast``: from the last rank, equals ``broadcast``'s result;
* the two in a row (the local-update step's allreduce of its outer change) equal ``all_reduce``.

Inputs that are small integers sum exactly in any order and every dtype, so these agree bit
for bit. Random floats are summed in another order by the ring than by Gloo: each of a sum of
three's two additions rounds by at most half a unit in the last place of a partial sum, so
two orders differ by at most ``2 * eps(dtype) * sum(|x_i|)`` elementwise, the bound asserted.
Chunks beyond ``sealed.SMALL_EXCHANGE_BYTES`` go around the ring, smaller ones in one direct
round: both are run.

Dtypes: float32/64, float16, bfloat16, complex64, int8, uint8, int32, int64 and bool (whose
sum is a logical or, as Gloo's). Gloo has no int16 (``Invalid scalar type``), so there is
no reference for it. The narrow wire's overflow rule (``fallback``): decided alike on every
rank, the sum taken from the full-precision chunks, even when one rank's shard alone overflowed.

``NcclTransport``'s own code (padding unequal chunks to equal pieces, the overflow redo) runs
here over the Gloo group, whose ``reduce_scatter_tensor``/``all_gather_into_tensor`` it calls as
it calls NCCL's; on NCCL itself with a GPU per rank (skipped otherwise: NCCL refuses two ranks on
one GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ringtrain as rt
from ringtrain import transport
from ringtrain.security import keys
from ringtrain.testing import spawn
from ringtrain.transport import ring as sealed
from ringtrain.transport.base import NcclTransport

pytestmark = pytest.mark.timeout(120)

SIZE = 3
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)
# NCCL has no complex or bool reductions of its own.
NCCL_DTYPES = tuple(d for d in DTYPES if d not in (torch.complex64, torch.bool))
# Element counts: unequal chunks with an empty one (2 at 3 ranks), unequal (7), equal (12), and
# one past SMALL_EXCHANGE_BYTES for the ring (float32 only: the ring's code knows no dtype).
SMALL = (2, 7, 12)
RING_DTYPES = (torch.float32,)


def _ring_numel(dtype: torch.dtype) -> int:
    """Equal chunks large enough that (n-1) x a chunk's bytes exceed the direct round's limit."""
    per_chunk = sealed.SMALL_EXCHANGE_BYTES // ((SIZE - 1) * dtype.itemsize) + 1000
    return SIZE * per_chunk


def _cut(flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """As the engine cuts a bucket (``exchange._cut``): ceil-sized shards, the last ones short."""
    shard = -(-flat.numel() // n)
    return [
        flat[min(r * shard, flat.numel()) : min((r + 1) * shard, flat.numel())] for r in range(n)
    ]


def _inputs(numel: int, dtype: torch.dtype, rank: int, exact: bool, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    if dtype == torch.bool:
        return (torch.randint(0, 2, (numel,), generator=g) > 0).to(device)
    if exact:  # small integers: exact sums in every dtype and order
        low = 0 if dtype == torch.uint8 else -3
        return torch.randint(low, 4, (numel,), generator=g).to(dtype).to(device)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype).to(device)


class _Check:
    """One transport's results against the reference group's, collected as readable lines."""

    def __init__(self, wire: transport.Transport, ref: Any, device: str) -> None:
        self.wire, self.ref, self.device = wire, ref, device
        self.rank, self.size = wire.rank, wire.size
        self.bad: list[str] = []
        self.checked = 0

    def same(self, what: str, got: torch.Tensor, want: torch.Tensor, bound: Any = None) -> None:
        self.checked += 1
        if bound is None:
            if not torch.equal(got, want):
                self.bad.append(f"{what}: {got.tolist()[:6]} != {want.tolist()[:6]}")
            return
        gap = (got.to(torch.complex128) - want.to(torch.complex128)).abs()
        if bool((gap > bound).any()):
            self.bad.append(f"{what}: off by {float(gap.max()):.3g} > bound")

    def bound(self, x: torch.Tensor, exact: bool) -> torch.Tensor | None:
        """None (bitwise) for exact inputs; else 2 eps(dtype) sum_i |x_i|, elementwise."""
        if exact or not (x.is_floating_point() or x.is_complex()):
            return None
        magnitude = x.abs().to(torch.float64)
        dist.all_reduce(magnitude, group=self.ref)
        eps = torch.finfo(x.real.dtype if x.is_complex() else x.dtype).eps
        return 2 * eps * magnitude

    def reduce_scatter(self, x: torch.Tensor, what: str, exact: bool) -> None:
        n, r = self.size, self.rank
        whole = x.clone()
        dist.all_reduce(whole, group=self.ref)
        bound = self.bound(x, exact)
        summed = x.clone()
        self.wire.allreduce(summed).wait()
        self.same(f"allreduce {what}", summed, whole, bound)
        mine = _cut(torch.arange(x.numel()), n)[r]
        piece = None if bound is None else bound[mine]
        chunks = _cut(x.clone(), n)
        assert self.wire.reduce_scatter(chunks).wait() in (None, False)
        self.same(f"reduce_scatter {what}", chunks[r], whole[mine], piece)
        if x.numel() % n == 0:
            out = torch.empty(x.numel() // n, dtype=x.dtype, device=self.device)
            dist.reduce_scatter_tensor(out, x.clone(), group=self.ref)
            self.same(f"reduce_scatter_tensor {what}", chunks[r], out, piece)
        self.wire.allgather(chunks).wait()  # rs + ag: the outer exchange's allreduce
        self.same(f"reduce_scatter+allgather {what}", torch.cat(chunks), whole, bound)

    def allgather(self, x: torch.Tensor, what: str) -> None:
        n, r = self.size, self.rank
        everyone = torch.empty(n * x.numel(), dtype=x.dtype, device=self.device)
        dist.all_gather_into_tensor(everyone, x, group=self.ref)
        chunks = _cut(torch.zeros_like(x), n)  # every chunk but this rank's is stale
        chunks[r].copy_(_cut(x, n)[r])
        self.wire.allgather(chunks).wait()
        want = [_cut(row, n)[i] for i, row in enumerate(everyone.view(n, -1))]
        self.same(f"allgather {what}", torch.cat(chunks), torch.cat(want))

    def broadcast(self, x: torch.Tensor, what: str) -> None:
        """From the last rank (a root that is not rank 0: its rank in the group counts)."""
        root = self.size - 1
        want = x.clone()
        dist.broadcast(want, group=self.ref, group_src=root)
        got = x.clone()
        self.wire.broadcast(got, root).wait()
        self.same(f"broadcast {what}", got, want)

    def overflow(self, only_rank: int | None) -> None:
        """fp16 chunks with a float32 fallback; ``only_rank``: only that rank's shard
        overflows (None: none does). Every rank must redo, or none."""
        n, r = self.size, self.rank
        exact = _inputs(6 * n, torch.float32, r, True, self.device)
        if only_rank is not None:  # 3 x 3e4 > 65504 = fp16's largest: inf in that shard only
            exact[6 * only_rank] = 3e4
        whole = exact.clone()
        dist.all_reduce(whole, group=self.ref)
        narrow, full = _cut(exact.half(), n), _cut(exact.clone(), n)
        redone = self.wire.reduce_scatter(narrow, full).wait()
        what = f"overflow on rank {only_rank}"
        self.same(
            f"{what}: redone", torch.tensor(bool(redone)), torch.tensor(only_rank is not None)
        )
        got = full[r] if redone else narrow[r].float()
        self.same(f"{what}: sum", got, _cut(whole, n)[r])


def _run_checks(wire: transport.Transport, ref: Any, device: str) -> tuple[list[str], int]:
    check = _Check(wire, ref, device)
    r = wire.rank
    for dtype in DTYPES if device == "cpu" else NCCL_DTYPES:
        numels = SMALL + ((_ring_numel(dtype),) if dtype in RING_DTYPES else ())
        floats = dtype.is_floating_point or dtype.is_complex
        for numel in numels:
            for exact in (True, False) if floats else (True,):
                what = f"{dtype} x{numel} {'exact' if exact else 'random'}"
                check.reduce_scatter(_inputs(numel, dtype, r, exact, device), what, exact)
            check.allgather(_inputs(numel, dtype, r, False, device), f"{dtype} x{numel}")
            check.broadcast(_inputs(numel, dtype, r, False, device), f"{dtype} x{numel}")
    for only_rank in (None, *range(wire.size)):
        check.overflow(only_rank)
    return check.bad, check.checked


def _with_reference(fn: Callable[[Any], Any]) -> Any:
    """``fn(group)`` with a plain Gloo group made for the reference, destroyed after."""
    ref = dist.new_group(backend="gloo")
    try:
        return fn(ref)
    finally:
        dist.destroy_process_group(ref)


def _engine_transport() -> tuple[str, list[str], int]:
    """The transport the engine gets over its group, against Gloo."""
    from ringtrain.runtime import state

    wire = transport.of(state.current().world.communicator.group("engine"))
    try:
        bad, checked = _with_reference(lambda ref: _run_checks(wire, ref, "cpu"))
    finally:
        wire.close()
    return type(wire).__name__, bad, checked


def _nccl_code_over_gloo() -> tuple[list[str], int]:
    """NcclTransport's own code, over a Gloo group."""

    def run(ref: Any) -> tuple[list[str], int]:
        return _run_checks(NcclTransport(ref), ref, "cpu")

    out: tuple[list[str], int] = _with_reference(run)
    return out


def _hierarchical_transport(hosts: str) -> tuple[str, list[str], int]:
    """The hierarchical allreduce as the engine gets it over a stream's group
    (``transport.of(group, hierarchical)``), ranks placed on ``hosts``, against Gloo."""
    from ringtrain.runtime import state
    from ringtrain.transport.hierarchical import HierarchicalAllreduce

    algorithm = HierarchicalAllreduce(tuple(hosts))
    wire = transport.of(state.current().world.communicator.group("engine"), algorithm)
    try:
        assert wire.cuts is False  # its reduce-scatter reduces every chunk
        bad, checked = _with_reference(lambda ref: _run_checks(wire, ref, "cpu"))
    finally:
        wire.close()
        algorithm.close()
    return type(wire).__name__, bad, checked


def _settings(tmp_path: Path) -> dict[str, dict[str, Any]]:
    key_file = keys.write_key_file(tmp_path / "job.key", keys.generate_job_key())
    return {
        "gloo": {},
        "sealed": {"secure": True, "key_file": key_file},
        "tcp": {"transport": "tcp"},
    }


KINDS = {"gloo": "RingTransport", "sealed": "RingGroupTransport", "tcp": "RingGroupTransport"}


def test_every_transport_matches_torch_distributed(tmp_path: Path) -> None:
    world = spawn.world(SIZE)
    for name, settings in _settings(tmp_path).items():
        for kind, bad, checked in world.run(_engine_transport, timeout=90, **settings):
            assert kind == KINDS[name], (name, kind)
            assert checked > 100 and not bad, (name, checked, bad)
    for bad, checked in world.run(_nccl_code_over_gloo, timeout=90):
        assert checked > 100 and not bad, ("NcclTransport over Gloo", checked, bad)


def test_the_hierarchical_allreduce_as_a_transport_matches_torch_distributed() -> None:
    """Two ranks on one host, one on another: a host reduce-scatter, a cross-host allreduce."""
    for hosts in ("aab", "aba"):
        for kind, bad, checked in spawn.world(SIZE).run(_hierarchical_transport, hosts, timeout=90):
            assert kind == "HierarchicalTransport"
            assert checked > 50 and not bad, (hosts, checked, bad)


def _nccl() -> tuple[str, list[str], int]:
    from ringtrain.runtime import state

    torch.cuda.set_device(rt.local_rank() % torch.cuda.device_count())
    group = state.current().world.communicator.group("nccl")
    wire = transport.of(group)
    bad, checked = _run_checks(wire, group, "cuda")
    return type(wire).__name__, bad, checked


@pytest.mark.skipif(
    torch.cuda.device_count() < SIZE,
    reason=f"needs {SIZE} CUDA GPUs (NCCL refuses two ranks on one GPU); "
    f"torch.cuda.device_count() is {torch.cuda.device_count()}",
)
def test_nccl_matches_its_own_collectives() -> None:
    for kind, bad, checked in spawn.world(SIZE).run(_nccl, timeout=90):
        assert kind == "NcclTransport" and checked > 100 and not bad, (kind, checked, bad)
