"""The block-quantized codecs, int8 and int4: a float32 vector in a quarter or an eighth of its
bytes, plus one float32 scale per :data:`BLOCK` values.

Per block, the scale is the block's largest magnitude over the level count (127 for int8, 7 for
int4), and each value is rounded to the nearest integer multiple of it: the error is at most half
a scale. int8 values travel as bytes; int4 two to a byte, offset by 8. Integers cannot be summed
on the wire without overflow, so these are *gathered* codecs: each rank's payload is
all-gathered and decoded, and the values summed in rank order on every rank (the local-update
step's outer exchange, ``engine/outer_codec.py``, which keeps the rounding's error as feedback).
They are not gradient compressions (``compression=``): the gradient exchange sums on the wire.
"""

from __future__ import annotations

import torch

BLOCK = 128


class BlockQuantized:
    """A gathered codec: ``compress`` a flat float32 vector into a uint8 payload,
    ``decompress`` it back (rounded)."""

    name = ""
    levels = 0
    bits = 0

    @classmethod
    def payload_bytes(cls, numel: int) -> int:
        """Bytes of the payload of ``numel`` values."""
        values = _blocks(numel) * BLOCK
        return values * cls.bits // 8 + 4 * _blocks(numel)

    @classmethod
    def compress(cls, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``x`` (float32, 1-D) as its payload, and the context ``decompress`` needs (its
        length)."""
        blocks = _blocks(x.numel())
        padded = torch.zeros(blocks * BLOCK)
        padded[: x.numel()] = x
        grid = padded.view(blocks, BLOCK)
        scale = grid.abs().amax(dim=1) / cls.levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(grid / safe[:, None]).clamp_(-cls.levels, cls.levels)
        body = cls._pack(q.to(torch.int8).reshape(-1))
        return torch.cat([body, scale.view(torch.uint8)]), x.numel()

    @classmethod
    def decompress(cls, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The float32 values :meth:`compress` packed (rounded)."""
        blocks = _blocks(numel)
        split = payload.numel() - 4 * blocks
        scale = payload[split:].clone().view(torch.float32)
        q = cls._unpack(payload[:split])
        return (q.view(blocks, BLOCK) * scale[:, None]).reshape(-1)[:numel]

    @staticmethod
    def _pack(q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _unpack(body: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Compressor(BlockQuantized):
    """One byte per value."""

    name = "int8"
    levels = 127
    bits = 8

    @staticmethod
    def _pack(q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.uint8)

    @staticmethod
    def _unpack(body: torch.Tensor) -> torch.Tensor:
        return body.view(torch.int8).float()


class Int4Compressor(BlockQuantized):
    """Two values per byte, each offset by 8 (so in 1..15)."""

    name = "int4"
    levels = 7
    bits = 4

    @staticmethod
    def _pack(q: torch.Tensor) -> torch.Tensor:
        u = (q + 8).to(torch.uint8)
        return u[0::2] * 16 + u[1::2]

    @staticmethod
    def _unpack(body: torch.Tensor) -> torch.Tensor:
        return torch.stack([body // 16, body % 16], dim=1).reshape(-1).float() - 8


def _blocks(numel: int) -> int:
    return -(-numel // BLOCK)
