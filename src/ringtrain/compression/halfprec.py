"""The summed codecs: none, and 16-bit compression, sending float gradients as fp16 or bf16,
halving the bytes on the wire.

fp16 has 5 exponent bits: values above 65504 overflow to inf. Allreduce sums in the wire dtype, so
the collectives divide by the world size *before* the sum when averaging 16-bit data, and the
DistributedOptimizer predivides likewise. A sum that overflows all the same is redone in full
precision by the engine's paths (:mod:`ringtrain.compression.overflow`), not by Horovod's
collectives (``hvd.allreduce(..., compression=fp16)``). bf16 keeps fp32's range with 8 bits of
mantissa: no overflow, coarser values. Non-float tensors pass through unchanged.

Every path that sends on these wires goes through the codec: Horovod's collectives call
``compress``/``decompress``; the gradient exchange (allreduce, reduce-scatter, hierarchical)
and the local-update step's outer exchange take a :class:`CastWire` from ``wire(buffer)``,
which casts into a wire buffer kept across steps (page faults on fresh tens of MiB cost more
than the casts) and declares the overflow fallback where the wire's range is narrower.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain.compression import overflow
from ringtrain.compression.base import Stateless, register
from ringtrain.compression.codec import Wire, scaled_into


class FP16Compressor(Stateless):
    """Casts floating-point tensors to float16 for the wire: an elementwise summed codec
    (:mod:`ringtrain.compression.codec`)."""

    name = "fp16"
    elementwise = True
    cast_to = torch.float16

    @classmethod
    def wire_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        return cls.cast_to if dtype.is_floating_point else dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.is_floating_point() and tensor.dtype != cls.cast_to:
            return tensor.to(cls.cast_to), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.to(ctx) if ctx is not None else tensor

    @classmethod
    def wire(cls, source: torch.Tensor) -> Wire:
        return CastWire(source, cls.wire_dtype(source.dtype))


class BF16Compressor(FP16Compressor):
    """Casts floating-point tensors to bfloat16 for the wire (fp32's range, less precision)."""

    name = "bf16"
    cast_to = torch.bfloat16


class NoneCompressor(Stateless):
    """The bucket travels as it is: the plain summed codec."""

    name = "none"
    elementwise = True

    @staticmethod
    def wire_dtype(dtype: torch.dtype) -> torch.dtype:
        return dtype

    @classmethod
    def wire(cls, source: torch.Tensor) -> Wire:
        return CastWire(source, source.dtype)


class CastWire:
    """An elementwise :class:`~ringtrain.compression.codec.Wire`: ``source`` cast to ``dtype``
    in a ``buffer`` kept across sends (the source itself where the dtypes agree), decoded by
    the cast back, scaled on the way. The fallback is declared where ``dtype``'s range is
    narrower than the source's (:func:`~ringtrain.compression.overflow.narrower`)."""

    def __init__(self, source: torch.Tensor, dtype: torch.dtype) -> None:
        self.source = source
        self.buffer = source
        if dtype != source.dtype:
            self.buffer = torch.zeros(source.numel(), dtype=dtype, device=source.device)
        self.redo_in_full = overflow.narrower(dtype, source.dtype)

    def encode(self) -> torch.Tensor:
        if self.buffer is not self.source:
            self.buffer.copy_(self.source)
        return self.buffer

    def decode_into(self, reduced: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
        scaled_into(reduced, out, scale)


register("none", NoneCompressor)
register("fp16", FP16Compressor)
register("bf16", BF16Compressor)
