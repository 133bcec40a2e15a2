"""Codecs: how a gradient bucket travels, and the state that travelling keeps.

Every ``compression=`` setting becomes one :class:`Codec` (:func:`as_codec`), of two kinds:

* **summed** (:class:`SummedCodec`: none, fp16, bf16, any Horovod-style compressor): the bucket
  is encoded (``compress``), summed on the wire by the bucket's reduction (allreduce,
  reduce-scatter, hierarchical), and decoded (``decompress``). The average's division is the
  reduction's, by the one rule (:mod:`ringtrain.compression.averaging`). An ``elementwise``
  codec's wire holds one value per gradient value (a cast): the engine casts into a wire buffer
  kept across steps, and can cut the wire into shards (reduce-scatter) as it cuts the bucket;
* **with rounds of its own** (:class:`RoundsCodec`: PowerSGD's low-rank factors, top-k's values
  and indices): ``reduce(bucket_key, flat, rounds)`` runs whatever collectives it needs on
  ``rounds`` (:class:`Rounds`, what :func:`ringtrain.transport.rounds` hands it) and returns the
  bucket's average. Such a bucket is reduced whole; a sharded step takes its shard after.

Sparse gradients (``nn.Embedding(sparse=True)``) are not in buckets: they travel as values and
indices (:class:`ringtrain.compression.sparse.SparseRows`), gathered in the same rounds.

A codec's state (error feedback, warm starts) is ``state_dict``/``load_state_dict``, saved with
the optimizer. Codecs never call ``torch.distributed``: their rounds go through the
:class:`Rounds` they are handed (tests/engine/test_no_collectives_in_engine.py), a protocol
defined here so that this package imports nothing above it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch


class Round(Protocol):
    """A collective under way."""

    def wait(self) -> Any: ...


class Rounds(Protocol):
    """The collectives a codec's rounds are written with, over the ranks of one process set.

    Issued from the calling thread (the engine calls a codec on the group's worker thread, one
    bucket after another in plan order, so every rank issues the same rounds in the same order).
    """

    rank: int
    size: int
    group: Any  # the process group underneath: for a reducer written against torch.distributed

    def allreduce(self, t: torch.Tensor) -> Round:
        """``t`` becomes the sum of every rank's ``t``, in place."""
        ...

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor) -> Round:
        """``out`` (size x ``t``'s elements) becomes every rank's ``t``, in rank order."""
        ...

    def all_gather(self, outs: list[torch.Tensor], t: torch.Tensor) -> Round:
        """``outs[r]`` becomes rank r's ``t``."""
        ...


@runtime_checkable
class Codec(Protocol):
    """How a bucket travels (see the module docstring)."""

    name: str
    own_rounds: bool  # False: a SummedCodec; True: a RoundsCodec

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class SummedCodec(Codec, Protocol):
    """Encoded, summed on the wire, decoded."""

    elementwise: bool

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype: ...

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class RoundsCodec(Codec, Protocol):
    """Reduces a whole bucket in rounds of its own."""

    def plan(self, bucket_key: str, shapes: Sequence[Sequence[int]]) -> None: ...

    def reduce(self, bucket_key: str, flat: torch.Tensor, rounds: Rounds) -> torch.Tensor: ...


def as_codec(compressor: Any) -> SummedCodec | RoundsCodec:
    """The codec of a resolved ``compression=`` object: built-in codecs are codecs already; a
    compressor of your own (``compress``/``decompress``) is summed, a reducer of your own
    (``reduce(bucket_key, flat, group)``) runs its rounds on the process group."""
    if isinstance(compressor, Codec):
        return compressor  # type: ignore[return-value]
    if callable(getattr(compressor, "reduce", None)):
        return _GroupReducer(compressor)
    return _Compressor(compressor)


class _Wrapped:
    """A user's compressor or reducer seen as a codec: its name, and its state where it has one."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.name = str(getattr(inner, "name", type(inner).__name__))

    def state_dict(self) -> dict[str, Any]:
        fn = getattr(self._inner, "state_dict", None)
        return dict(fn()) if callable(fn) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        fn = getattr(self._inner, "load_state_dict", None)
        if callable(fn):
            fn(state)


class _Compressor(_Wrapped):
    """A summed codec over a Horovod-style compressor: its wire is whatever it makes."""

    own_rounds = False
    elementwise = False  # unknown: never cut into shards, never cast into a kept buffer

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        wire: torch.Tensor = self._inner.compress(torch.zeros(1, dtype=dtype))[0]
        return wire.dtype

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out: tuple[torch.Tensor, Any] = self._inner.compress(tensor)
        return out

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        out: torch.Tensor = self._inner.decompress(tensor, ctx)
        return out


class _GroupReducer(_Wrapped):
    """A rounds codec over a reducer written against torch.distributed: it gets the group."""

    own_rounds = True

    def plan(self, bucket_key: str, shapes: Sequence[Sequence[int]]) -> None:
        fn = getattr(self._inner, "plan", None)
        if callable(fn):
            fn(bucket_key, shapes)

    def reduce(self, bucket_key: str, flat: torch.Tensor, rounds: Rounds) -> torch.Tensor:
        out: torch.Tensor = self._inner.reduce(bucket_key, flat, rounds.group)
        return out
