"""``horovod.torch.compression``'s names: ``Compression`` and the compressor classes.

``NoneCompressor`` and ``FP16Compressor`` are the classes ``Compression.none`` and
``Compression.fp16`` name; ``Compressor`` is ringtrain's protocol for a compressor (``name``,
``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``), not Horovod's base class.
"""

from __future__ import annotations

from ringtrain.compression import Compression, Compressor, FP16Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]
