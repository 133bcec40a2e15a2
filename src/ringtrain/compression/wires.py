"""The wires a flat float32 vector can be averaged on, by name: the local-update step's outer
exchange (``outer_compression``, ``engine/outer_codec.py``) offers exactly these.

* summed (none, fp16, bf16: the gradient codecs, :mod:`ringtrain.compression.halfprec`): cast,
  summed on the wire, with the narrow wire's overflow rule (:mod:`ringtrain.compression.overflow`);
* gathered (int8, int4: :mod:`ringtrain.compression.quantized`): each rank's payload
  all-gathered, decoded and summed in rank order.
"""

from __future__ import annotations

from ringtrain.compression.base import Stateless
from ringtrain.compression.halfprec import BF16Compressor, FP16Compressor, NoneCompressor
from ringtrain.compression.quantized import BlockQuantized, Int4Compressor, Int8Compressor

WIRES: dict[str, type[Stateless] | type[BlockQuantized]] = {
    c.name: c
    for c in (NoneCompressor, FP16Compressor, BF16Compressor, Int8Compressor, Int4Compressor)
}
