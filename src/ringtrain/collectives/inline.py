"""Small allreduces, allgathers and broadcasts carried inside the negotiation round.

Every collective is negotiated before it runs: one allgather of each rank's control message. For
an op of a few KiB that round can carry the data as well, and the op needs no Gloo collective of
its own (on loopback that is about half of a small op's latency):

* allreduce: each rank puts its tensors' bytes in its message; once every contributing rank has
  done so, every rank reduces the same bytes in the same rank order on its own, so the results
  are identical everywhere;
* allgather (objects included): each rank puts its tensors' bytes in its message; once every
  contributing rank has done so, every rank concatenates them in rank order;
* broadcast (objects included): the root puts its tensors' bytes in its message, and every
  other rank takes them from there.

Whether an op went inline is decided from the messages every rank received alike, never from
local state, so all ranks take the same path; an op some rank could not inline (too large, a
CUDA tensor, an error) simply runs as a normal collective everywhere. In secure mode the control
group is sealed like every other group, so inline data is encrypted too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from ringtrain.collectives import dtypes
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.errors import CollectiveArgumentError, CollectiveMismatchError
from ringtrain.transport import views

# An op this small (all its tensors together) travels in the negotiation round, while a rank's
# control message carries no more than INLINE_MAX_PER_MESSAGE in all: the round moves a fixed
# slot of CONTROL_SLOT_BYTES (8 KiB) per rank anyway, so data that fits costs no extra bytes.
# A burst of small ops beyond that budget runs as normal (fused) collectives.
INLINE_MAX_BYTES = 4096
INLINE_MAX_PER_MESSAGE = 6144

# (reduction dtype, or "bytes" for a broadcast or allgather; the tensors' raw bytes, back to back)
Payload = tuple[str, bytes]


def encode(request: Request, tensors: Sequence[torch.Tensor], rank: int) -> Payload | None:
    """What this rank (``rank``: its global rank) sends inline for ``request``, or None (not
    small, not inlinable, or nothing to send: a broadcast's receivers)."""
    if request.error or request.kind not in ("allreduce", "allgather", "broadcast"):
        return None
    if request.kind == "broadcast" and rank != request.root:  # roots are global ranks
        return None
    if not request.derived("inline", _small):  # asked of every op: the request says it once
        return None
    if not inlinable_size(tensors):
        return None
    if request.kind in ("broadcast", "allgather"):
        return "bytes", b"".join(dtypes.as_bytes(t).numpy().tobytes() for t in tensors)
    return _encode_reduction(tensors, request.op)


def usable(
    request: Request,
    payloads: Mapping[int, Payload],
    submitted: Iterable[int],
    set_ranks: Sequence[int],
) -> bool:
    """Whether the op runs inline: every submitting rank's data arrived (allreduce: joined ranks
    add zeros), or the root's (broadcast). Every rank decides alike, from the messages.
    ``payloads`` and ``submitted`` are by set rank; ``set_ranks`` maps them to global ranks."""
    if request.kind == "broadcast":
        return request.root in set_ranks and set_ranks.index(request.root) in payloads
    return payloads.keys() == set(submitted)


def _encode_reduction(tensors: Sequence[torch.Tensor], op: str) -> Payload | None:
    try:
        work = dtypes.to_reducible_all(list(tensors), op)
    except CollectiveArgumentError:
        return None  # the normal path reports it, on every rank
    dtype = work[0].dtype
    if any(w.dtype != dtype for w in work):
        return None
    flat = torch.cat([w.reshape(-1) for w in work]) if len(work) > 1 else work[0]
    return str(dtype), views.as_u8(flat).numpy().tobytes()


def reduce(
    name: str,
    payloads: Mapping[int, Payload],
    op: str,
    prescale: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """The reduction of every rank's payload (rank order, so bitwise alike on every rank), flat
    in the reduction dtype; ``prescale`` is applied to each contribution first."""
    ranks = sorted(payloads)
    kinds = {payloads[r][0] for r in ranks}
    sizes = {len(payloads[r][1]) for r in ranks}
    if len(kinds) != 1 or len(sizes) != 1:
        seen = ", ".join(
            f"rank {r}: {len(payloads[r][1])} bytes of {payloads[r][0]}" for r in ranks
        )
        raise CollectiveMismatchError(
            f"allreduce {name!r} got tensors of different sizes or dtypes ({seen}).\n"
            "HINT: every rank must pass tensors of the same shapes and dtypes."
        )
    dtype = dtypes.from_name(kinds.pop())
    stack = torch.stack([torch.frombuffer(bytearray(payloads[r][1]), dtype=dtype) for r in ranks])
    prescale(stack)
    return reduce_rows(stack, op)


def reduce_rows(stack: torch.Tensor, op: str) -> torch.Tensor:
    """``op`` over the rows of ``stack`` (one per rank, in rank order), in the rows' dtype."""
    if op in ("Sum", "Average"):
        out = stack.sum(0)
    elif op == "Min":
        out = stack.amin(0)
    elif op == "Max":
        out = stack.amax(0)
    elif op == "Product":
        out = stack.prod(0)
    else:  # pragma: no cover - requests are validated at submission
        raise CollectiveArgumentError(f"unknown reduce op {op!r}")
    return out.to(stack.dtype)  # integer sums and products come back as int64


def _small(request: Request) -> bool:
    """Whether the request's tensors may be small enough to travel inline (their metadata's
    bytes; inlinable_size decides from the tensors themselves)."""
    nbytes = dtypes.nbytes_of(request.tensors)
    return nbytes <= INLINE_MAX_BYTES and all(m.device == "cpu" for m in request.tensors)


def inlinable_size(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are small enough (and on the CPU) to travel inline."""
    nbytes = 0
    for t in tensors:  # stops at the first large tensor: grouped calls can hold thousands
        nbytes += t.numel() * t.element_size()
        if nbytes > INLINE_MAX_BYTES or t.device.type != "cpu" or t.is_sparse:
            return False
    return nbytes > 0


def take(payload: Payload, offset: int, out: torch.Tensor) -> None:
    """Fill the uint8 view ``out`` from a broadcast payload, starting at byte ``offset``."""
    n = out.numel()
    chunk = payload[1][offset : offset + n]
    if len(chunk) != n:  # only when consistency checks are off: they catch this first
        raise CollectiveMismatchError(
            f"broadcast: the root sent {len(payload[1])} bytes in all, this rank expects more.\n"
            "HINT: every rank must pass tensors of the root's shapes and dtypes."
        )
    if n:
        out.view(-1).copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))


def split(
    name: str, payloads: Mapping[int, Payload], metas: Mapping[int, Sequence[TensorMeta]]
) -> dict[int, list[bytes]]:
    """Each rank's allgather payload cut into its tensors' bytes, sized as its request says."""
    out: dict[int, list[bytes]] = {}
    for r in sorted(payloads):
        data, pieces, start = payloads[r][1], [], 0
        for meta in metas[r]:
            n = math.prod(meta.shape) * dtypes.from_name(meta.dtype).itemsize
            pieces.append(data[start : start + n])
            start += n
        if start != len(data):  # only when consistency checks are off: they catch this first
            raise CollectiveMismatchError(
                f"allgather {name!r}: rank {r} sent {len(data)} bytes, its request describes "
                f"{start}.\nHINT: every rank must pass tensors of the same dtypes and trailing "
                "shapes."
            )
        out[r] = pieces
    return out
