"""Gradient codecs, registered by name, and the one averaging rule.

Every ``compression=`` setting is a codec (:mod:`ringtrain.compression.codec`): none, fp16 and
bf16 are summed on the wire; PowerSGD and top-k run rounds of their own on the
:class:`~ringtrain.compression.codec.Rounds` the engine hands them (never ``torch.distributed``
itself). :mod:`ringtrain.compression.averaging` is how every path averages.
"""

from ringtrain.compression.base import CompressionLike, Compressor, register, resolve
from ringtrain.compression.codec import Codec, Rounds, RoundsCodec, SummedCodec, as_codec
from ringtrain.compression.halfprec import BF16Compressor, FP16Compressor, NoneCompressor
from ringtrain.compression.horovod import Compression
from ringtrain.compression.policy import AutoCompression
from ringtrain.compression.powersgd import PowerSGDReducer
from ringtrain.compression.topk import TopKReducer

__all__ = [
    "AutoCompression",
    "BF16Compressor",
    "Codec",
    "Compression",
    "CompressionLike",
    "Compressor",
    "FP16Compressor",
    "NoneCompressor",
    "PowerSGDReducer",
    "Rounds",
    "RoundsCodec",
    "SummedCodec",
    "TopKReducer",
    "as_codec",
    "register",
    "resolve",
]
