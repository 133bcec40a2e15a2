"""Horovod's ``Compression`` namespace, over ringtrain's codecs.

``Compression.none`` and ``Compression.fp16`` as in Horovod, plus ``bf16`` and the gradient
reducers: ``Compression.powersgd`` (settings from Config) or
``Compression.powersgd(matrix_approximation_rank=4)``, likewise ``Compression.topk(ratio=...)``.
Each is the codec's own class (registered by name where it is defined), so
``compression=Compression.fp16`` and ``compression="fp16"`` are one codec.
"""

from __future__ import annotations

from ringtrain.compression.halfprec import BF16Compressor, FP16Compressor, NoneCompressor
from ringtrain.compression.powersgd import PowerSGDReducer
from ringtrain.compression.topk import TopKReducer


class Compression:
    """Horovod's namespace (see the module docstring)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
    powersgd = PowerSGDReducer
    topk = TopKReducer
