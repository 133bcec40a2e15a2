"""The compressor protocol and the registry of compressors by name.

A compressor turns a tensor into what travels (``compress``) and back (``decompress``), with a
context for whatever decompression needs. Stateless compressors (fp16, bf16) work for any
collective; stateful ones (top-k with error feedback, PowerSGD) keep per-tensor state, exposed via
``state_dict``/``load_state_dict`` so it is saved with the optimizer.

Horovod spells these ``Compression.none`` and ``Compression.fp16``; both spellings work here.

Every compressor is a codec (:mod:`ringtrain.compression.codec`). Those whose output cannot
simply be summed (top-k, PowerSGD) run rounds of their own on the
:class:`~ringtrain.compression.codec.Rounds` the engine hands them; a reducer of your own may
instead implement :class:`GradientReducer` and receive the process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch

from ringtrain.compression.codec import CompressedWire, Wire
from ringtrain.errors import ConfigError


@runtime_checkable
class Compressor(Protocol):
    """What every compressor offers. ``name`` is its registry key."""

    name: str

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor: ...


@runtime_checkable
class GradientReducer(Protocol):
    """A reducer of your own: reduces a whole gradient bucket itself, with torch.distributed
    collectives on the group it is given (the built-in codecs take a
    :class:`~ringtrain.compression.codec.Rounds` instead: :class:`~ringtrain.compression.codec.
    RoundsCodec`).

    DistributedOptimizer calls, for every fusion bucket of every step::

        averaged = reducer.reduce(bucket_key, flat, group)

    * ``bucket_key`` names the bucket (``"bucket0"``, ``"bucket1"``, ...), stable while the
      bucket plan stands; keep per-bucket state (error feedback, warm starts) under it.
    * ``flat`` is the bucket: this rank's gradients, flattened and concatenated (1-D, the
      gradients' dtype). Do not keep or modify it; it is reused next step.
    * ``group`` is the ``torch.distributed`` group of the process set (Gloo). Issue collectives
      on it synchronously and in an order that depends only on the bucket key and on data
      every rank has, never on timing: every rank calls ``reduce`` for the same buckets in the
      same order (on one engine thread, so backward continues meanwhile), and the engine issues
      no other collective on ``group`` while a call runs.
    * Return the *average* of ``flat`` over the group, a new tensor of the same shape and dtype.
      The engine applies Sum and ``backward_passes_per_step`` scaling itself.

    Optional: ``plan(bucket_key, shapes)`` is called once per bucket whenever a new plan is made,
    with the shapes of the gradients packed in the bucket, in order. ``state_dict()`` and
    ``load_state_dict()`` are saved in and restored from the DistributedOptimizer's state_dict.
    """

    name: str

    def reduce(self, bucket_key: str, flat: torch.Tensor, group: Any) -> torch.Tensor: ...


# What a ``compression=`` argument takes: a registered name ("fp16", "powersgd", "auto"), a class
# (Horovod's ``Compression.fp16``) or an instance (``Compression.powersgd(...)``); None: "none".
CompressionLike: TypeAlias = (
    str | type[Compressor] | type[GradientReducer] | Compressor | GradientReducer
)


class Stateless:
    """Base for compressors without state; they can be used as classes, as in Horovod. They are
    summed codecs (:class:`ringtrain.compression.codec.SummedCodec`)."""

    name = "none"
    own_rounds = False
    elementwise = False

    @classmethod
    def wire_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        return cls.compress(torch.zeros(1, dtype=dtype))[0].dtype

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor

    @classmethod
    def wire(cls, source: torch.Tensor) -> Wire:
        """How ``source`` travels: compressed anew each send (elementwise casts keep a buffer:
        :class:`ringtrain.compression.halfprec.CastWire`)."""
        return CompressedWire(cls, source)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


_REGISTRY: dict[str, Callable[..., Any]] = {}


def register(name: str, factory: Callable[..., Any]) -> None:
    """Make a compressor available as ``compression="name"`` and ``RINGTRAIN_COMPRESSION=name``."""
    _REGISTRY[name] = factory


def unregister(name: str) -> None:
    """Forget ``name`` (a codec registered for a while, as a test's); unknown names are fine."""
    _REGISTRY.pop(name, None)


def resolve(compression: CompressionLike | None, config: Any = None) -> Any:
    """A compressor object from a name, a class (Horovod style) or an instance.

    ``config`` (a :class:`ringtrain.config.Config`): names and classes with a ``from_config``
    classmethod are built from it (``powersgd_rank``, ``topk_ratio``, ...); an instance is used
    as it is, so arguments given to it win.
    """
    if compression is None:
        compression = "none"
    if isinstance(compression, str):
        if compression not in _REGISTRY:
            raise ConfigError(
                f"unknown compression {compression!r}; known: {', '.join(sorted(_REGISTRY))}\n"
                "HINT: check RINGTRAIN_COMPRESSION and the compression= argument."
            )
        return _build(_REGISTRY[compression], config)
    if isinstance(compression, type):
        return _build(compression, config)
    if not isinstance(compression, (Compressor, GradientReducer)):
        raise ConfigError(
            f"compression must be a name or have compress()/decompress() or reduce(), got "
            f"{compression!r}"
        )
    return compression


def _build(factory: Callable[..., Any], config: Any) -> Any:
    from_config = getattr(factory, "from_config", None)
    if config is not None and callable(from_config):
        return from_config(config)
    return factory()


def names() -> list[str]:
    return sorted(_REGISTRY)
