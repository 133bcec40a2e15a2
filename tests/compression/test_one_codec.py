"""One codec object carries a summed wire on every path: a fix to the fp16 codec is one file.

A marker codec, registered for this test under ``"marker"`` (fp16's bytes: a subclass of
:class:`~ringtrain.compression.halfprec.FP16Compressor` that records each call made to it), is
given by name to each path that sends a summed wire, on 2 ranks:

* the optimizer's path (``DistributedOptimizer(compression="marker")``: the exchange's
  allreduce): the exchange takes one wire per bucket (``wire``) and each step calls its
  ``encode`` and its ``decode_into``;
* the reduce-scatter (``shard_optimizer`` + ``reduce_scatter``): the same, on shards;
* ``hvd.allreduce(..., compression="marker")``: Horovod's protocol, ``compress`` and
  ``decompress``;
* the local-update step's outer exchange (``OuterCodec("marker", ...)``): ``wire``,
  ``encode``, ``decode``.

Each path must call the marker, and give fp16's result bit for bit (so nothing beside the
codec shaped the bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import ringtrain as rt
from ringtrain import transport
from ringtrain.compression import base, wires
from ringtrain.compression.codec import Wire
from ringtrain.compression.halfprec import FP16Compressor
from ringtrain.engine.outer_codec import OuterCodec
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(120)

SIZE = 2
CALLS: list[str] = []  # this rank's record of the marker's calls


class _RecordingWire:
    """fp16's wire, recording ``encode`` and ``decode``."""

    def __init__(self, inner: Wire) -> None:
        self._inner = inner
        self.source, self.buffer, self.redo_in_full = inner.source, inner.buffer, inner.redo_in_full

    def encode(self) -> torch.Tensor:
        CALLS.append("encode")
        return self._inner.encode()

    def decode_into(self, reduced: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
        CALLS.append("decode")
        self._inner.decode_into(reduced, out, scale)


class Marker(FP16Compressor):
    """fp16, recording every call made to the codec."""

    name = "marker"

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        CALLS.append("compress")
        return super().compress(tensor)

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        CALLS.append("decompress")
        return FP16Compressor.decompress(tensor, ctx)

    @classmethod
    def wire(cls, source: torch.Tensor) -> Wire:
        CALLS.append("wire")
        return _RecordingWire(super().wire(source))


@contextmanager
def _registered() -> Iterator[None]:
    """``"marker"`` as a gradient codec and an outer wire, for the call only."""
    base.register("marker", Marker)
    wires.WIRES["marker"] = Marker
    try:
        yield
    finally:
        base.unregister("marker")
        del wires.WIRES["marker"]


def _values() -> torch.Tensor:
    return torch.randn(10, generator=torch.Generator().manual_seed(rt.rank())) * 3


def _gradient(codec: str, **scatter: bool) -> torch.Tensor:
    """One bucket's averaged gradient through the optimizer's path."""
    w = torch.nn.Parameter(torch.zeros(10))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)], compression=codec, **scatter
    )
    (w * _values()).sum().backward()
    opt.synchronize()  # reduce-scatter: the reduced shards all-gathered
    assert opt._exchange is not None and w.grad is not None
    assert opt._exchange.scatters == bool(scatter)
    grad = w.grad.detach().clone()
    with opt.skip_synchronize():
        opt.step()
    opt.remove_hooks()
    return grad


def _outer(codec: str) -> torch.Tensor:
    from ringtrain.runtime import state

    wire = transport.of(state.current().world.communicator.group("engine"))
    try:
        return OuterCodec(codec, wire).average(_values())
    finally:
        wire.close()


PATHS: dict[str, Callable[[str], torch.Tensor]] = {
    "optimizer": _gradient,
    "reduce-scatter": lambda c: _gradient(c, shard_optimizer=True, reduce_scatter=True),
    "hvd.allreduce": lambda c: rt.allreduce(_values(), compression=c),
    "outer exchange": _outer,
}


def _each_path() -> dict[str, tuple[list[str], bool]]:
    """Per path: the marker's calls, and whether its result is fp16's bit for bit."""
    seen = {}
    with _registered():
        for name, path in PATHS.items():
            CALLS.clear()
            got = path("marker")
            calls = list(CALLS)
            CALLS.clear()
            seen[name] = (calls, torch.equal(got, path("fp16")))
            assert CALLS == []  # fp16 is another codec: the marker saw nothing of it
    return seen


def test_every_summed_path_goes_through_the_one_codec() -> None:
    results = spawn.world(SIZE).run(_each_path, timeout=90)
    for rank, seen in enumerate(results):
        for name, (calls, same) in seen.items():
            if name == "hvd.allreduce":
                assert set(calls) == {"compress", "decompress"}, (rank, name, calls)
            else:
                assert calls[0] == "wire" and {"encode", "decode"} <= set(calls), (rank, calls)
            assert same, (rank, name)
