"""Codecs: how a gradient bucket travels, and the state that travelling keeps.

Every ``compression=`` setting becomes one :class:`Codec` (:func:`as_codec`), of two kinds:

* **summed** (:class:`SummedCodec`: none, fp16, bf16, any Horovod-style compressor): the codec
  owns the bytes. For each buffer it sends, a sender (the engine: one per bucket, kept across
  steps; the outer exchange: one per average) asks the codec for a :class:`Wire`: its
  ``encode`` turns the buffer into what travels, its ``decode_into`` reads a reduced wire back,
  and it declares its overflow fallback (``redo_in_full``: a reduced wire holding inf or nan is
  reduced again from the full-precision buffer, by :mod:`ringtrain.compression.overflow`). What sums
  the wire (allreduce, reduce-scatter, hierarchical) is the sender's; the average's division is
  the reduction's, by the one rule (:mod:`ringtrain.compression.averaging`). An ``elementwise``
  codec's wire holds one value per buffer value (a cast) in a ``buffer`` kept across sends, so
  it can be cut into shards (reduce-scatter) as the bucket is. Horovod's collectives
  (``hvd.allreduce(..., compression=...)``) call ``compress``/``decompress``, Horovod's
  protocol, of the same codec object;
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

from ringtrain.compression import overflow


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


class Wire(Protocol):
    """One buffer's way onto a summed codec's wire and back, made by :meth:`SummedCodec.wire`.

    ``source`` is the buffer (its values change between sends, its storage does not).
    ``encode()`` returns what to reduce: ``buffer`` (written anew each time) where there is one,
    else a tensor made by this call. After the reduction, ``decode_into(reduced, out, scale)``
    writes ``scale`` times the decoded sum into ``out`` (``reduced``: what ``encode`` returned,
    or, for an elementwise wire, a shard of ``buffer``, decoded into the same shard of
    ``source``). ``redo_in_full``: the declared overflow fallback (the wire's range is narrower
    than the source's): where the reduced wire holds inf or nan, the sender reduces ``source``
    instead (:func:`ringtrain.compression.overflow.redo_if_not_finite`) and decodes nothing.
    """

    @property
    def source(self) -> torch.Tensor: ...

    @property
    def buffer(self) -> torch.Tensor | None: ...

    @property
    def redo_in_full(self) -> bool: ...

    def encode(self) -> torch.Tensor: ...

    def decode_into(self, reduced: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None: ...


class SummedCodec(Codec, Protocol):
    """Encoded, summed on the wire, decoded: through the :class:`Wire` it makes per buffer."""

    elementwise: bool

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype: ...

    def wire(self, source: torch.Tensor) -> Wire: ...

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

    def wire(self, source: torch.Tensor) -> Wire:
        return CompressedWire(self, source)

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


class _Compressing(Protocol):
    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype: ...

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class CompressedWire:
    """The :class:`Wire` of a codec known only by ``compress``/``decompress`` (a Horovod-style
    compressor): each ``encode`` compresses the source anew, ``decode_into`` decompresses. Its
    wire cannot be cut into shards (``buffer`` None)."""

    buffer: torch.Tensor | None = None

    def __init__(self, codec: _Compressing, source: torch.Tensor) -> None:
        self.source = source
        self._codec = codec
        self.redo_in_full = overflow.narrower(codec.wire_dtype(source.dtype), source.dtype)
        self._ctx: Any = None

    def encode(self) -> torch.Tensor:
        sent, self._ctx = self._codec.compress(self.source)
        return sent

    def decode_into(self, reduced: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
        # A compressor that sent the source itself summed it in place: nothing to decompress.
        result = reduced if reduced is out else self._codec.decompress(reduced, self._ctx)
        scaled_into(result, out, scale)


def scaled_into(result: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """``out`` becomes ``scale * result`` (flattened), in one pass; in place where ``result``
    is ``out``'s own storage (then a scale of 1 costs nothing)."""
    if result is out or (
        result.data_ptr() == out.data_ptr()
        and result.shape == out.shape
        and result.dtype == out.dtype
        and result.stride() == out.stride()
    ):
        if scale != 1.0:
            out.mul_(scale)
    elif scale != 1.0:
        torch.mul(result.view(-1), scale, out=out)
    else:
        out.copy_(result.view(-1))
