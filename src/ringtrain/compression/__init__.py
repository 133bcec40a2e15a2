"""Gradient compressors, registered by name.

Stateless wire casts (fp16, bf16) are plain tensor code. Gradient reducers (PowerSGD, top-k) own
their collectives: they are given a torch.distributed group and never import ringtrain's runtime.
"""

from ringtrain.compression.base import CompressionLike, Compressor, register, resolve
from ringtrain.compression.halfprec import (
    BF16Compressor,
    Compression,
    FP16Compressor,
    NoneCompressor,
)
from ringtrain.compression.policy import AutoCompression
from ringtrain.compression.powersgd import PowerSGDReducer
from ringtrain.compression.topk import TopKReducer

__all__ = [
    "AutoCompression",
    "BF16Compressor",
    "Compression",
    "CompressionLike",
    "Compressor",
    "FP16Compressor",
    "NoneCompressor",
    "PowerSGDReducer",
    "TopKReducer",
    "register",
    "resolve",
]
