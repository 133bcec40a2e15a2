"""The ring: ringtrain's own collectives over point-to-point messages, each message passed
through the session the ring is given: :class:`Plain` (bytes as they are: the ``ringtrain_tcp``
groups and the ring the engine runs over a Gloo group) or a sealing
:class:`~ringtrain.security.sealing.Session` (the ``ringtrain_sealed`` groups: every byte between
ranks AES-256-GCM sealed, and opened before use, so the wire only ever sees ciphertext).

The collectives run over ``send``/``recv`` of uint8 tensors on a plain Gloo group or the tcp
mesh (:class:`~ringtrain.transport.tcp_mesh.Mesh`); below, "seal" and "open" pass the bytes
through unchanged with :class:`Plain`:

* **allreduce**: a ring. Reduce-scatter (n-1 steps: each rank seals one chunk for its right
  neighbour, opens the chunk from its left one and reduces it into its own), then allgather
  (n-1 steps: each rank seals the chunk it finished *once*, for every member, and the ring
  forwards that blob unchanged; every rank opens it). Each rank sends 2(n-1)/n of the tensor,
  as a plain ring does; it seals once per reduce-scatter step plus once, and opens 2(n-1)
  times. Every element is reduced by exactly one rank, so results are identical on every rank.
* **reducescatter**: the ring's first phase, shifted so rank r ends with chunk r.
* **allgather**: each rank seals its piece once for everyone; the ring forwards the blobs.
* **broadcast**: the root seals once for everyone and sends the blob to each member.
* **alltoall**: n-1 pairwise steps, each piece sealed for its one receiver.
* **barrier**: an allgather of empty messages (authenticated all the same).

Small exchanges, where n-1 times the largest piece is at most :data:`SMALL_EXCHANGE_BYTES` (the
same decision on every rank), take one direct round instead of n-1 ring steps (either phase
above): the same bytes sent and received, each piece sealed as often as in the ring. A small
message's time is its rounds' latency, and each round of a sealed collective is a Python round
trip (seal, post, wait, open), not a few microseconds of Gloo's C++. A direct reduce-scatter
sends chunk j straight to the rank that reduces it, which reduces the n copies in rank order.
An allreduce with ``bytes * (n-1)`` within the limit is one direct allgather of the whole
tensors, each rank then reducing the n of them in rank order: one round instead of 2(n-1).

Large chunks are cut into segments of :data:`SEGMENT_BYTES`, so sealing one segment overlaps
sending the previous one. Reductions happen in the tensor's dtype, in ring order (rank order in
a direct round): results match a plain allreduce exactly at two ranks and up to float rounding
beyond, and are identical on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from ringtrain.compression import averaging
from ringtrain.errors import CollectiveArgumentError
from ringtrain.security import sealing
from ringtrain.security.sealing import EVERYONE, Session, sealed_size
from ringtrain.transport import views

# Sealing runs in this thread while Gloo's threads move the previous segment.
SEGMENT_BYTES = 1 << 20
# Exchanges where n-1 times the largest piece is at most this many bytes go in one direct round
# (every piece straight to every member) instead of a ring; allreduces that small are an
# allgather of the whole tensors, reduced locally.
SMALL_EXCHANGE_BYTES = 1 << 20

_Reduce = Callable[[torch.Tensor, torch.Tensor], object]
# A dist.ReduceOp member (dist.ReduceOp.SUM, ...).
ReduceOp = dist.ReduceOp.RedOpType


class Posted(Protocol):
    """A send or receive under way."""

    def wait(self) -> object: ...


class Channel(Protocol):
    """What the ring sends over: a Gloo group's point-to-point, or the TCP mesh's."""

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int, /) -> Posted: ...

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int, /) -> Posted: ...


def _reducer(op: ReduceOp) -> tuple[_Reduce, bool]:
    """(in-place reduce of ``acc`` with ``incoming``, whether to divide by n afterwards)."""
    R = dist.ReduceOp
    if op == R.SUM:
        return (lambda acc, x: acc.add_(x)), False
    if op == R.AVG:
        return (lambda acc, x: acc.add_(x)), True
    if op == R.PRODUCT:
        return (lambda acc, x: acc.mul_(x)), False
    if op == R.MIN:
        return (lambda acc, x: torch.minimum(acc, x, out=acc)), False
    if op == R.MAX:
        return (lambda acc, x: torch.maximum(acc, x, out=acc)), False
    if op == R.BAND:
        return (lambda acc, x: acc.bitwise_and_(x)), False
    if op == R.BOR:
        return (lambda acc, x: acc.bitwise_or_(x)), False
    if op == R.BXOR:
        return (lambda acc, x: acc.bitwise_xor_(x)), False
    raise CollectiveArgumentError(f"the sealed backend does not support reduce op {op}")


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()) if t.numel() else memoryview(bytearray(0))  # type: ignore[arg-type]


# Posted messages, the buffer the next piece arrives in, and where it is reduced into.
_Pending = tuple[tuple[list[Posted], list[torch.Tensor]], torch.Tensor, torch.Tensor]


class Plain:
    """No sealing: the ring's bytes travel as they are (the ``ringtrain_tcp`` backend, and the
    engine's reduce-scatter of gradients over its own groups)."""

    def __init__(self, me: int, size: int) -> None:
        self.me, self.size = me, size


class Ring:
    """The ring: its collectives over a point-to-point channel (a Gloo group, or
    :class:`~ringtrain.transport.tcp_mesh.Mesh`), each message passed through the session kind
    it is given (a sealing session, or :class:`Plain`)."""

    def __init__(self, inner: Channel, session: Session | Plain) -> None:
        self.inner = inner
        self.session = session
        self.rank = session.me
        self.size = session.size
        self.plain = isinstance(session, Plain)
        self._overhead = 0 if self.plain else sealed_size(0)

    def detach(self) -> Channel:
        """Hand the channel over (to close it); the ring is not used after."""
        inner = self.inner
        del self.inner
        return inner

    def _wire(self, t: torch.Tensor) -> int:
        """Bytes on the wire for ``t``."""
        return _nbytes(t) + self._overhead

    # ---- primitives --------------------------------------------------------------------------

    def seal(self, peer: int, kind: int, data: torch.Tensor) -> torch.Tensor:
        """``data``'s bytes sealed for ``peer`` (or ``EVERYONE``), as a uint8 tensor."""
        src = views.as_u8(data)
        if isinstance(self.session, Plain):
            return src  # sent as it is; nothing changes it before the send completes
        blob = torch.empty(sealed_size(src.numel()), dtype=torch.uint8)
        self.session.seal_into(peer, kind, _mv(src), _mv(blob))
        return blob

    def open(
        self, peer: int, kind: int, blob: torch.Tensor, out: torch.Tensor, to_all: bool = False
    ) -> None:
        """Open ``blob`` from ``peer`` into ``out``'s bytes (raises SecurityError naming it)."""
        if isinstance(self.session, Plain):
            dst = views.as_u8(out)
            if dst.numel() and dst.data_ptr() != blob.data_ptr():
                dst.copy_(blob)
            return
        self.session.open_into(peer, kind, _mv(blob), _mv(views.as_u8(out)), to_all)

    def start(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, int]]
    ) -> tuple[list[Posted], list[torch.Tensor]]:
        """Post blob sends and receives of known sizes; :meth:`finish` waits for them."""
        got = [torch.empty(n, dtype=torch.uint8) for _, n in recvs]
        works = [self.inner.recv([b], peer, 0) for (peer, _), b in zip(recvs, got)]
        works += [self.inner.send([blob], peer, 0) for peer, blob in sends]
        return works, got

    @staticmethod
    def finish(posted: tuple[list[Posted], list[torch.Tensor]]) -> list[torch.Tensor]:
        for w in posted[0]:
            w.wait()
        return posted[1]

    def post(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, int]]
    ) -> list[torch.Tensor]:
        """Send blobs and receive blobs of known sizes, all at once; returns the received."""
        return self.finish(self.start(sends, recvs))

    # ---- collectives -------------------------------------------------------------------------

    def allreduce(self, t: torch.Tensor, op: ReduceOp) -> None:
        """Reduce ``t`` in place across the group."""
        n, r = self.size, self.rank
        if n == 1:
            return
        reduce, divide = _reducer(op)
        flat = t.reshape(-1)
        if _nbytes(flat) * (n - 1) <= SMALL_EXCHANGE_BYTES:
            self._allreduce_by_allgather(flat, reduce)
        else:
            bounds = [flat.numel() * i // n for i in range(n + 1)]
            chunks = [flat[bounds[i] : bounds[i + 1]] for i in range(n)]
            self._reduce_scatter(chunks, reduce, offset=0, kind=sealing.ALLREDUCE)
            # Rank r now holds the result of chunk r+1; share the finished chunks in the ring.
            self._allgather(chunks, first=(r + 1) % n, origin=lambda c: (c - 1) % n)
        if divide:
            _divide(flat, n)

    def _allreduce_by_allgather(self, flat: torch.Tensor, reduce: _Reduce) -> None:
        """Every rank's whole tensor to everyone, then the same reduction, in rank order, on
        every rank (for small tensors: see :data:`SMALL_EXCHANGE_BYTES`)."""
        pieces = [flat if i == self.rank else torch.empty_like(flat) for i in range(self.size)]
        self._allgather(pieces, first=self.rank, origin=lambda c: c, kind=sealing.ALLREDUCE)
        acc = pieces[0]  # rank 0's piece: ``flat`` itself on rank 0, a received copy elsewhere
        for piece in pieces[1:]:
            reduce(acc, piece)
        if acc is not flat:
            flat.copy_(acc)

    def reducescatter(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp) -> None:
        """``out`` (rank r) = reduction of chunk r of every rank's ``inp`` (n equal chunks)."""
        n = self.size
        reduce, divide = _reducer(op)
        work = inp.reshape(-1).clone()
        k = out.numel()
        chunks = [work[i * k : (i + 1) * k] for i in range(n)]
        if n > 1:
            self._reduce_scatter(chunks, reduce, offset=-1, kind=sealing.REDUCESCATTER)
        mine = chunks[self.rank]
        if divide:
            _divide(mine, n)
        out.reshape(-1).copy_(mine)

    def reduce_scatter_chunks(self, chunks: Sequence[torch.Tensor], op: ReduceOp) -> None:
        """Afterwards rank r's ``chunks[r]`` holds the reduction of every rank's ``chunks[r]``
        (in place; the other chunks hold partial results). Chunk sizes may differ, alike on
        every rank. (N-1)/N of the data leaves each rank: half an allreduce's bytes."""
        if self.size == 1:
            return
        reduce, divide = _reducer(op)
        self._reduce_scatter(list(chunks), reduce, offset=-1, kind=sealing.REDUCESCATTER)
        if divide:
            _divide(chunks[self.rank], self.size)

    def allgather_chunks(self, chunks: Sequence[torch.Tensor]) -> None:
        """Afterwards every rank's ``chunks[i]`` holds rank i's ``chunks[i]`` (in place)."""
        if self.size > 1:
            self._allgather(list(chunks), first=self.rank, origin=lambda c: c)

    def allgather(self, outs: Sequence[torch.Tensor], inp: torch.Tensor) -> None:
        """``outs[i]`` = rank i's ``inp`` (sizes may differ; each ``outs[i]`` sized for it)."""
        r = self.rank
        outs[r].reshape(-1).copy_(inp.reshape(-1))
        if self.size > 1:
            self._allgather(list(outs), first=r, origin=lambda c: c)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """Every rank's ``t`` = the root's."""
        if self.size == 1:
            return
        if self.rank == root:
            blob = self.seal(EVERYONE, sealing.BROADCAST, t.contiguous())
            self.post([(p, blob) for p in range(self.size) if p != root], [])
            return
        (blob,) = self.post([], [(root, self._wire(t))])
        target = (
            t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        )
        self.open(root, sealing.BROADCAST, blob, target, to_all=True)
        if target is not t:
            t.copy_(target)

    def alltoall(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
        """``outs[j]`` = rank j's ``ins[self]``: n-1 pairwise sealed exchanges."""
        n, r = self.size, self.rank
        outs[r].reshape(-1).copy_(ins[r].reshape(-1))
        for s in range(1, n):
            to, frm = (r + s) % n, (r - s) % n
            blob = self.seal(to, sealing.ALLTOALL, ins[to].contiguous())
            (got,) = self.post([(to, blob)], [(frm, self._wire(outs[frm]))])
            self.open(frm, sealing.ALLTOALL, got, outs[frm])

    def barrier(self) -> None:
        empty = [torch.empty(0, dtype=torch.uint8) for _ in range(self.size)]
        if self.size > 1:
            self._allgather(empty, first=self.rank, origin=lambda c: c, kind=sealing.BARRIER)

    def send(self, t: torch.Tensor, peer: int) -> None:
        self.post([(peer, self.seal(peer, sealing.P2P, t.contiguous()))], [])

    def recv(self, t: torch.Tensor, peer: int) -> None:
        (blob,) = self.post([], [(peer, self._wire(t))])
        self.open(peer, sealing.P2P, blob, t)

    # ---- ring phases -------------------------------------------------------------------------

    def _reduce_scatter(
        self, chunks: list[torch.Tensor], reduce: _Reduce, offset: int, kind: int
    ) -> None:
        """Afterwards rank r holds the full reduction of chunk (r + 1 + offset): in one direct
        round when chunks are small, else around the ring."""
        mine = (self.rank + 1 + offset) % self.size
        if _small(chunks):
            self._direct_reduce_scatter(chunks, reduce, mine, offset, kind)
        else:
            self._ring_reduce_scatter(chunks, reduce, offset, kind)

    def _direct_reduce_scatter(
        self, chunks: list[torch.Tensor], reduce: _Reduce, mine: int, offset: int, kind: int
    ) -> None:
        """One round: chunk j, sealed for its reducer alone, goes straight to the rank that ends
        with it; each rank reduces the n copies of its chunk in rank order."""
        n, r = self.size, self.rank
        sends = [
            (owner, self.seal(owner, kind, chunks[j]))
            for j in range(n)
            if (owner := (j - 1 - offset) % n) != r
        ]
        peers = [p for p in range(n) if p != r]
        target = chunks[mine]
        got = self.post(sends, [(p, self._wire(target)) for p in peers])
        copies = {r: target}
        for p, blob in zip(peers, got):
            copies[p] = torch.empty_like(target)
            self.open(p, kind, blob, copies[p])
        acc = copies[0]  # reduced in rank order: ``target`` itself on rank 0, a copy elsewhere
        for p in range(1, n):
            reduce(acc, copies[p])
        if acc is not target:
            target.copy_(acc)

    def _ring_reduce_scatter(
        self, chunks: list[torch.Tensor], reduce: _Reduce, offset: int, kind: int
    ) -> None:
        """n-1 steps; afterwards rank r holds the full reduction of chunk (r + 1 + offset).

        Segments pipeline: segment i+1 is sealed while segment i travels, and segment i is opened
        and reduced while segment i+1 travels.
        """
        n, r = self.size, self.rank
        right, left = (r + 1) % n, (r - 1) % n
        count = _segment_count(chunks)
        scratch = torch.empty(max(c.numel() for c in chunks), dtype=chunks[0].dtype)
        for s in range(n - 1):
            out_chunk = chunks[(r - s + offset) % n]
            in_chunk = chunks[(r - s - 1 + offset) % n]
            pending: _Pending | None = None
            for i in range(count):
                a, b = _cut(out_chunk.numel(), count, i)
                c, d = _cut(in_chunk.numel(), count, i)
                blob = self.seal(right, kind, out_chunk[a:b])
                incoming = scratch[c:d]
                posted = self.start([(right, blob)], [(left, self._wire(incoming))])
                if pending is not None:
                    self._absorb(pending, left, kind, reduce)
                pending = (posted, incoming, in_chunk[c:d])
            if pending is not None:
                self._absorb(pending, left, kind, reduce)

    def _absorb(self, pending: _Pending, left: int, kind: int, reduce: _Reduce) -> None:
        posted, incoming, target = pending
        (got,) = self.finish(posted)
        self.open(left, kind, got, incoming)
        reduce(target, incoming)

    def _allgather(
        self,
        pieces: list[torch.Tensor],
        first: int,
        origin: Callable[[int], int],
        kind: int = sealing.ALLGATHER,
    ) -> None:
        """Rank r holds ``pieces[first]``, sent by rank ``origin(i)`` for piece i; afterwards it
        holds every piece: in one direct round when they are small, else around the ring."""
        if _small(pieces):
            self._direct_allgather(pieces, first, origin, kind)
        else:
            self._ring_allgather(pieces, first, origin, kind)

    def _direct_allgather(
        self, pieces: list[torch.Tensor], first: int, origin: Callable[[int], int], kind: int
    ) -> None:
        """One round: this rank's piece, sealed once, goes to every member at once."""
        r = self.rank
        blob = self.seal(EVERYONE, kind, pieces[first].reshape(-1))
        others = [i for i in range(len(pieces)) if i != first]
        got = self.post(
            [(p, blob) for p in range(self.size) if p != r],
            [(origin(i), self._wire(pieces[i])) for i in others],
        )
        for i, g in zip(others, got):
            self.open(origin(i), kind, g, pieces[i].reshape(-1), to_all=True)

    def _ring_allgather(
        self,
        pieces: list[torch.Tensor],
        first: int,
        origin: Callable[[int], int],
        kind: int = sealing.ALLGATHER,
    ) -> None:
        """Rank r holds ``pieces[first]``; after n-1 steps it holds every piece.

        The holder of a piece seals it once for everyone (segment by segment); the ring forwards
        the blobs unchanged, and every rank opens them.
        """
        n, r = self.size, self.rank
        right, left = (r + 1) % n, (r - 1) % n
        count = _segment_count(pieces)
        mine = pieces[first].reshape(-1)
        blobs: list[torch.Tensor] = []
        for s in range(n - 1):
            idx = (first - s - 1) % n
            piece = pieces[idx].reshape(-1)
            sender = origin(idx)
            posted = []
            for i in range(count):
                if s == 0:  # seal segment by segment, each sent as soon as it is sealed
                    a, b = _cut(mine.numel(), count, i)
                    blobs.append(self.seal(EVERYONE, kind, mine[a:b]))
                c, d = _cut(piece.numel(), count, i)
                posted.append(
                    (self.start([(right, blobs[i])], [(left, self._wire(piece[c:d]))]), c, d)
                )
            blobs = []
            for p, c, d in posted:
                (got,) = self.finish(p)
                self.open(sender, kind, got, piece[c:d], to_all=True)
                blobs.append(got)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _small(pieces: Sequence[torch.Tensor]) -> bool:
    """Whether an exchange of ``pieces`` takes one direct round. Decided from the largest piece,
    so every rank decides the same, whichever piece it holds."""
    largest = max(_nbytes(p) for p in pieces)
    return largest * (len(pieces) - 1) <= SMALL_EXCHANGE_BYTES


def _segment_count(chunks: Sequence[torch.Tensor]) -> int:
    """Segments per chunk: the same on every rank (it depends on the largest chunk only)."""
    largest = max(c.numel() * c.element_size() for c in chunks)
    return max(1, -(-largest // SEGMENT_BYTES))


def _cut(numel: int, count: int, i: int) -> tuple[int, int]:
    return numel * i // count, numel * (i + 1) // count


def _divide(t: torch.Tensor, n: int) -> None:
    averaging.mean(t, n)  # the one averaging rule: integers truncate toward zero, as Horovod
