"""The narrow wire's overflow rule on every path that sums on a 16-bit wire, on 3 ranks.

The rule (``ringtrain.compression.overflow.redo_if_not_finite``): a 16-bit sum that holds inf
or nan is taken again in full precision, decided alike on every rank. Its paths:

* the gradient exchange's allreduce: tests/engine/test_engine.py
  (``test_fp16_large_gradients_do_not_overflow``, ``test_predivide_gives_the_average_on_every_wire``)
  and tests/engine/test_overlap.py (two overlapped optimizers);
* a transport's reduce-scatter, alone: tests/transport/test_transports.py;
* here, the gradient exchange's reduce-scatter (``shard_optimizer`` + ``reduce_scatter``) and
  the local-update step's outer exchange (``engine/outer_codec.py``), each with the overflow in
  one rank's shard only, so that rank alone sees it: every rank must redo, and then every
  value (not only the overflowing shard's) is the full-precision one.

Stated tolerance: every element within float32's rounding of the average (``FULL``: 4 float32
units of the element's mean magnitude), where the fp16 wire's own rounding is 2^-11 of it: the
redo shows in every element, not only in the overflowing shard.
"""

from __future__ import annotations

import pytest
import torch

import ringtrain as rt
from ringtrain import transport
from ringtrain.engine.outer_codec import OuterCodec
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(120)

SIZE = 3
FULL = 4 * torch.finfo(torch.float32).eps
SHARD = 8  # elements per rank's shard
BIG = 1e5  # above fp16's largest (65504), its third below


def _values(rank: int) -> torch.Tensor:
    """This rank's vector: random values (not exact in fp16), and BIG in shard 1 only."""
    x = torch.randn(SIZE * SHARD, generator=torch.Generator().manual_seed(rank))
    x[SHARD] = BIG
    return x


def _average() -> torch.Tensor:
    return torch.stack([_values(r).double() for r in range(SIZE)]).mean(0)


def _sharded_gradients(compression: str) -> tuple[torch.Tensor, bool]:
    """The averaged gradient of a one-bucket model, reduce-scattered on the fp16 wire."""
    w = torch.nn.Parameter(torch.zeros(SIZE * SHARD))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD([w], lr=0.0),
        named_parameters=[("w", w)],
        compression=compression,
        shard_optimizer=True,
        reduce_scatter=True,
        fusion_threshold_bytes=1 << 20,
    )
    (w * _values(rt.rank())).sum().backward()
    opt.synchronize()  # all-gathers the reduced shards: whole averaged gradients
    assert opt._exchange is not None and w.grad is not None
    grad, scattered = w.grad.detach().clone(), opt._exchange.scatters
    with opt.skip_synchronize():
        opt.step()
    opt.remove_hooks()
    return grad, scattered


def _outer(name: str, overflowing: bool) -> tuple[torch.Tensor, float]:
    """The outer exchange's average and this rank's residual's largest magnitude after it."""
    from ringtrain.runtime import state

    x = _values(rt.rank())
    if not overflowing:
        x[SHARD] = 1.0
    wire = transport.of(state.current().world.communicator.group("engine"))
    try:
        codec = OuterCodec(name, wire)
        out = codec.average(x)
        assert codec.residual is not None
        return out, float(codec.residual.abs().max())
    finally:
        wire.close()


def _paths() -> dict[str, object]:
    return {
        "sharded fp16": _sharded_gradients("fp16"),
        "outer fp16": _outer("fp16", True),
        "outer fp16, no overflow": _outer("fp16", False),
        "outer bf16, no overflow": _outer("bf16", False),
    }


def _magnitude(big: float) -> torch.Tensor:
    """Elementwise mean over ranks of |x_i|: what a sum's rounding scales with."""
    xs = [_values(r).double() for r in range(SIZE)]
    for x in xs:
        x[SHARD] = big
    return torch.stack(xs).abs().mean(0)


def test_every_rank_redoes_in_full_precision_when_one_shard_overflows() -> None:
    results = spawn.world(SIZE).run(_paths, timeout=90)
    for name in results[0]:  # alike on every rank, bit for bit
        assert all(torch.equal(r[name][0], results[0][name][0]) for r in results), name
    want, bound = _average(), FULL * _magnitude(BIG)
    grad, scattered = results[0]["sharded fp16"]
    assert scattered
    assert bool(((grad.double() - want).abs() <= bound).all()), "sharded fp16"
    out, _ = results[0]["outer fp16"]
    assert bool(((out.double() - want).abs() <= bound).all()), "outer fp16"
    assert all(r["outer fp16"][1] == 0.0 for r in results)  # nothing owed: the sum was exact
    # Without overflow the 16-bit wire's rounding shows, and goes into the residual.
    calm = want.clone()
    calm[SHARD] = 1.0
    for name in ("outer fp16, no overflow", "outer bf16, no overflow"):
        out, owed = results[0][name]
        assert bool(((out.double() - calm).abs() > FULL * _magnitude(1.0)).any()), name
        assert owed > 0.0, name
