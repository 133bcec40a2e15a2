"""How the local-update step's outer change travels: averaged over ranks, compressed.

One flat float32 vector per rank (the change of its weights since the last outer step) goes in;
the same average comes out on every rank. The wire (``outer_compression``):

* ``"none"``: float32, ring allreduce (reduce-scatter, then all-gather) over the transport;
* ``"fp16"``, ``"bf16"``: the vector divided by the world size before the cast, encoded and
  decoded by the gradient codec's own wire (``FP16Compressor.wire``: what the gradient exchange
  uses), summed in the ring in 16 bits; a sum that overflows (any rank's chunk not finite) is
  redone in float32, decided alike everywhere: the wire's declared fallback, applied by the
  transport's reduce-scatter (:func:`ringtrain.compression.overflow.redo_if_not_finite`);
* ``"int8"``, ``"int4"``: each rank's vector quantized per block of 128 values with one float32
  scale per block (:mod:`ringtrain.compression.quantized`), all-gathered, and decoded and summed
  in rank order on every rank (integers cannot be summed on the wire without overflow).

The codecs are :data:`ringtrain.compression.wires.WIRES`, by name; this module averages with them.

Every narrow wire keeps **error feedback**: what this rank's rounding lost is added to its next
vector, so nothing is lost for good, only late (as in streaming DiLoCo's 4-bit outer gradients).
Sums follow a fixed order (the ring's, or rank order): every rank ends with the same bits, and
timing never changes them.
"""

from __future__ import annotations

from typing import Any

import torch

from ringtrain import transport
from ringtrain.compression import averaging
from ringtrain.compression.base import Stateless
from ringtrain.compression.quantized import BlockQuantized
from ringtrain.compression.wires import WIRES
from ringtrain.errors import ConfigError

CODECS = tuple(WIRES)


def check(name: str) -> str:
    if name not in WIRES:  # the table as it is now: a codec registered late counts
        raise ConfigError(
            f"outer_compression must be one of {', '.join(WIRES)}, got {name!r}\n"
            "HINT: fp16 halves the outer exchange; int8 and int4 cut it 4x and 8x, with error "
            "feedback."
        )
    return name


class OuterCodec:
    """Averages one flat vector over a transport's ranks (see the module docstring)."""

    def __init__(self, name: str, wire: transport.Transport) -> None:
        self.name = check(name)
        self._codec = WIRES[name]
        self._wire = wire
        self.residual: torch.Tensor | None = None  # error feedback, this rank's own
        self.bytes_sent = 0  # by this rank, over the whole job: what the link carried

    @property
    def size(self) -> int:
        return self._wire.size

    def wire_bytes(self, numel: int) -> int:
        """Bytes one rank sends for one average of ``numel`` values."""
        n = self.size
        if n == 1:
            return 0
        if issubclass(self._codec, BlockQuantized):
            return (n - 1) * self._codec.payload_bytes(numel)
        elem = self._codec.wire_dtype(torch.float32).itemsize
        return 2 * (n - 1) * numel * elem // n

    def average(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of every rank's ``flat`` (float32, 1-D); the same on every rank."""
        n = self.size
        if n == 1:
            return flat.clone()
        self.bytes_sent += self.wire_bytes(flat.numel())
        if self.name == "none":
            out = flat.clone()
            self._allreduce(out)
            return averaging.mean(out, n)
        x = flat if self.residual is None else flat + self.residual
        if issubclass(self._codec, BlockQuantized):
            return self._average_quantized(x, self._codec)
        return self._average_16(x, self._codec)

    def _chunks(self, t: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.tensor_split(t, self.size))

    def _allreduce(self, t: torch.Tensor, fallback: torch.Tensor | None = None) -> bool:
        chunks = self._chunks(t)
        fb = self._chunks(fallback) if fallback is not None else None
        redone = bool(self._wire.reduce_scatter(chunks, fb).wait())
        self._wire.allgather(fb if redone and fb is not None else chunks).wait()
        return redone

    def _average_16(self, x: torch.Tensor, codec: type[Stateless]) -> torch.Tensor:
        n = self.size
        scaled = averaging.mean(x.clone(), n)  # divided before the 16-bit sum (the rule)
        wire = codec.wire(scaled)  # the gradient codec's own wire (compression.codec)
        sent = wire.encode()
        mine = torch.empty_like(scaled)
        wire.decode_into(sent, mine)  # this rank's share as the wire carries it
        self.residual = x - mine * n
        # The wire's declared fallback: the sum redone from ``scaled`` (compression.overflow).
        if self._allreduce(sent, fallback=scaled if wire.redo_in_full else None):
            self.residual = torch.zeros_like(x)  # the sum went in float32: nothing was lost
            return scaled
        wire.decode_into(sent, mine)
        return mine

    def _average_quantized(self, x: torch.Tensor, codec: type[BlockQuantized]) -> torch.Tensor:
        mine, numel = codec.compress(x)
        self.residual = x - codec.decompress(mine, numel)
        pieces = [
            mine if r == self._wire.rank else torch.empty_like(mine) for r in range(self.size)
        ]
        self._wire.allgather(pieces).wait()
        total = torch.zeros(numel)
        for piece in pieces:  # rank order: the same sum on every rank
            total += codec.decompress(piece, numel)
        return averaging.mean(total, self.size)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "residual": self.residual}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """``device``: where the vectors it averages live (the parameters'); default: as saved."""
        if state.get("name") != self.name:
            raise ConfigError(
                f"the saved outer exchange used {state.get('name')!r}, this one {self.name!r}.\n"
                "HINT: resume with the outer_compression you saved with."
            )
        residual = state.get("residual")
        self.residual = None if residual is None else residual.to(device, copy=True)
