"""Every rank takes rank 0's anchor and outer optimizer state, sending a copy only where needed.

A local-update step (:mod:`ringtrain.engine.local_update`) keeps every rank's weights equal at
its outer steps only while every rank holds the same anchor and outer optimizer state. After a
start, a load or an elastic re-forming they may differ (a rank joined, or started from another
seed), so the first outer step compares a digest of every rank's (32 bytes a rank) and, only
where they differ, copies rank 0's to every rank. Ranks that start alike (the usual case) so
send no copy of the weights: on a slow link that copy cost as much as several outer steps.
Nothing here depends on timing: the digest is of the bits.
"""

from __future__ import annotations

import hashlib
import io

import torch

from ringtrain import transport


def from_root(
    wire: transport.Transport, anchor: list[torch.Tensor], outer: torch.optim.Optimizer
) -> list[torch.Tensor] | None:
    """Collective. None where every rank's digest is rank 0's; else rank 0's anchor (in host
    memory) on every rank, and ``outer`` loaded with rank 0's state (serialized, so a rank that
    joined without outer state gets it whole)."""
    if _all_alike(wire, digest(anchor, outer)):
        return None
    buf = io.BytesIO()
    if wire.rank == 0:
        torch.save({"anchor": anchor, "outer": outer.state_dict()}, buf)
    blob = _broadcast_bytes(wire, buf.getvalue())
    if wire.rank == 0:
        return list(anchor)
    got = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    outer.load_state_dict(got["outer"])
    return list(got["anchor"])


def digest(anchor: list[torch.Tensor], outer: torch.optim.Optimizer) -> bytes:
    """SHA-256 of the anchor's and the outer optimizer state's bits (32 bytes)."""
    h = hashlib.sha256()
    tensors = list(anchor)
    state = outer.state_dict()["state"]  # keyed by parameter index
    for pid in sorted(state):
        for key in sorted(state[pid]):
            value = state[pid][key]
            h.update(f"{pid}:{key}".encode())
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            else:
                h.update(repr(value).encode())
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def _all_alike(wire: transport.Transport, mine_digest: bytes) -> bool:
    """Whether every rank's digest is the same (an all-gather of 32 bytes a rank)."""
    mine = torch.frombuffer(bytearray(mine_digest), dtype=torch.uint8)
    pieces = [mine if r == wire.rank else torch.empty_like(mine) for r in range(wire.size)]
    wire.allgather(pieces).wait()
    return all(torch.equal(p, pieces[0]) for p in pieces)


def _broadcast_bytes(wire: transport.Transport, data: bytes) -> bytes:
    """Rank 0's ``data`` on every rank: its length, then its bytes, each a broadcast."""
    length = torch.tensor([len(data) if wire.rank == 0 else 0], dtype=torch.int64)
    wire.broadcast(length, 0).wait()
    size = int(length.item())
    if size == 0:
        return b""
    if wire.rank == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.empty(size, dtype=torch.uint8)
    wire.broadcast(buf, 0).wait()
    return bytes(buf.numpy().tobytes())
