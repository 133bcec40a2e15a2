"""The compressor protocol and the registry of compressors by name.

A compressor turns a tensor into what travels (``compress``) and back (``decompress``), with a
context for whatever decompression needs. Stateless compressors (fp16, bf16) work for any
collective; stateful ones (top-k with error feedback, PowerSGD) keep per-tensor state, exposed via
``state_dict``/``load_state_dict`` so it is saved with the optimizer.

Horovod spells these ``Compression.none`` and ``Compression.fp16``; both spellings work here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from ringtrain.errors import ConfigError


@runtime_checkable
class Compressor(Protocol):
    """What every compressor offers. ``name`` is its registry key."""

    name: str

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]: ...

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor: ...


class Stateless:
    """Base for compressors without state; they can be used as classes, as in Horovod."""

    name = "none"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


_REGISTRY: dict[str, Callable[..., Any]] = {}


def register(name: str, factory: Callable[..., Any]) -> None:
    """Make a compressor available as ``compression="name"`` and ``RINGTRAIN_COMPRESSION=name``."""
    _REGISTRY[name] = factory


def resolve(compression: Any) -> Any:
    """A compressor object from a name, a class (Horovod style) or an instance."""
    if compression is None:
        compression = "none"
    if isinstance(compression, str):
        if compression not in _REGISTRY:
            raise ConfigError(
                f"unknown compression {compression!r}; known: {', '.join(sorted(_REGISTRY))}"
            )
        return _REGISTRY[compression]()
    if isinstance(compression, type):
        return compression()
    if not isinstance(compression, Compressor):
        raise ConfigError(
            f"compression must be a name or have compress()/decompress(), got {compression!r}"
        )
    return compression


def names() -> list[str]:
    return sorted(_REGISTRY)
