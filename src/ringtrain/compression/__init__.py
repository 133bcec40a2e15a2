"""Gradient compressors: one protocol, registered by name. Plain tensor code, no communication."""

from ringtrain.compression.base import Compressor, register, resolve
from ringtrain.compression.halfprec import (
    BF16Compressor,
    Compression,
    FP16Compressor,
    NoneCompressor,
)

__all__ = [
    "BF16Compressor",
    "Compression",
    "Compressor",
    "FP16Compressor",
    "NoneCompressor",
    "register",
    "resolve",
]
