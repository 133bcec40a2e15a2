"""Sealing: AES-256-GCM with per-session keys and per-link sequence numbers.

A :class:`Session` serves one process group for its lifetime. Its key is derived from the job's
sealing subkey and the random values every member drew when the group was created, so two
sessions never share a key: not two groups, not two generations of one job, not a restarted job.
Within a session a nonce is ``sender (2 bytes) | receiver (2 bytes) | sequence (8 bytes)`` where
the sequence counts the messages on that link, so no (key, nonce) pair is ever used twice.

A sealed message (a *blob*) is ``sequence (8 bytes, big endian) | ciphertext | tag (16 bytes)``.
The sequence travels in the clear only to explain failures; the receiver derives the nonce from
the sequence it *expects*, and the additional authenticated data binds the job id, the session
(group), sender, receiver, operation kind and sequence. So a receiver accepts a message only if
it is the next one on that link, for that operation, from that sender, sealed with this
session's key; anything else raises :class:`~ringtrain.errors.SecurityError` naming the peer:

* a sequence below the expected one: a replayed message;
* a sequence above it: a reordered (or dropped) message;
* the expected sequence but a failed tag: a modified message, or one sealed with another key.

Messages to every member at once (a broadcast's payload, sealed once by the root) use the
receiver id ``0xFFFF`` and their own per-sender sequence.

Fault injection (:func:`inject_fault`) is a testing API: it is only ever switched on by a call in
the process that sends, never by the environment.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from ringtrain.errors import ConfigError, InternalError, SecurityError
from ringtrain.security import keys

HEADER = 8
TAG = 16
OVERHEAD = HEADER + TAG
EVERYONE = 0xFFFF
MAX_MEMBERS = 0xFFFF

# Operation kinds bound into every message.
ALLREDUCE, BROADCAST, ALLGATHER, REDUCESCATTER, ALLTOALL, BARRIER, P2P, SETUP = range(1, 9)
KIND_NAMES = {
    ALLREDUCE: "allreduce",
    BROADCAST: "broadcast",
    ALLGATHER: "allgather",
    REDUCESCATTER: "reducescatter",
    ALLTOALL: "alltoall",
    BARRIER: "barrier",
    P2P: "send/recv",
    SETUP: "setup",
}


@dataclass(frozen=True)
class Member:
    """Who a group member is, for binding and for error messages."""

    rank: int  # global rank
    host: str

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host})" if self.host else f"rank {self.rank}"


def sealed_size(nbytes: int) -> int:
    """Bytes on the wire for ``nbytes`` of plaintext."""
    return nbytes + OVERHEAD


class Session:
    """The sealing state of one group on one rank: a key, and a counter per link and direction.

    Not thread-safe: one session is used by the one thread that drives its group.
    """

    def __init__(
        self,
        sealing_key: bytes,
        job_id: str,
        me: int,
        members: Sequence[Member],
        randoms: Sequence[bytes],
    ) -> None:
        if len(members) > MAX_MEMBERS:
            raise ConfigError(f"secure mode supports up to {MAX_MEMBERS - 1} ranks per group")
        if len(randoms) != len(members) or not all(len(r) >= 16 for r in randoms):
            raise InternalError("a session needs one random value of >= 16 bytes per member")
        digest = hashlib.sha256()
        for r, m in zip(randoms, members):
            digest.update(r + struct.pack(">q", m.rank))
        self.tag = digest.digest()
        # Imported here: ``ringtrain.init`` imports this module (through the TCP backend) in
        # every job, and a job that seals nothing must run where `cryptography` is missing.
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._invalid_tag = InvalidTag
        job = job_id.encode()
        self._aead = AESGCM(keys.derive(sealing_key, "session", job + b"\x00" + self.tag))
        self._aad_prefix = b"ringtrain/v1\x00" + job + b"\x00" + self.tag[:16]
        self.me = me
        self.members = tuple(members)
        n = len(members)
        self._sent = [0] * (n + 1)  # index n: messages to everyone
        self._received = [0] * n
        self._received_all = [0] * n

    @property
    def size(self) -> int:
        return len(self.members)

    # ---- sealing ---------------------------------------------------------------------------

    def seal(self, peer: int, kind: int, data: bytes | memoryview) -> bytes:
        """Seal ``data`` for group member ``peer`` (``EVERYONE`` for a message to all)."""
        out = bytearray(sealed_size(len(memoryview(data).cast("B"))))
        self.seal_into(peer, kind, data, memoryview(out))
        return bytes(out)

    def seal_into(self, peer: int, kind: int, data: bytes | memoryview, out: memoryview) -> None:
        """Seal ``data`` into ``out``, which holds exactly ``sealed_size(len(data))`` bytes."""
        slot = self.size if peer == EVERYONE else peer
        seq = self._sent[slot]
        self._sent[slot] = seq + 1
        fault = None
        if _faults.active:
            fault = _faults.take(self.me, peer)
            held = _faults.held.pop((id(self), slot), None)
            if (
                held is not None
            ):  # the message a "reorder" skipped goes out now, after its successor
                seq = held
            elif fault == "reorder":
                _faults.held[(id(self), slot)] = seq
                seq += 1
        out[:HEADER] = struct.pack(">Q", seq)
        self._aead.encrypt_into(
            _nonce(self.me, peer, seq), data, self._aad(self.me, peer, kind, seq), out[HEADER:]
        )
        if fault == "flip":
            out[HEADER + (len(out) - HEADER) // 2] ^= 0x01
        elif fault == "replay":
            old = _faults.replay(id(self), peer, len(out))
            if old is None:  # nothing of this size sent to that peer yet: tamper with a later one
                _faults.set("replay", self.me, None, 0)
            else:
                out[:] = old
        if _faults.active:
            _faults.remember(id(self), peer, bytes(out))

    def open(
        self, peer: int, kind: int, blob: bytes | bytearray | memoryview, to_all: bool = False
    ) -> bytes:
        """Open a blob from group member ``peer``; raises :class:`SecurityError` naming it."""
        out = bytearray(max(0, len(memoryview(blob).cast("B")) - OVERHEAD))
        self.open_into(peer, kind, blob, memoryview(out), to_all)
        return bytes(out)

    def open_into(
        self,
        peer: int,
        kind: int,
        blob: bytes | bytearray | memoryview,
        out: memoryview,
        to_all: bool = False,
    ) -> None:
        """Open a blob from ``peer`` into ``out`` (``len(blob) - OVERHEAD`` bytes).

        ``to_all``: the blob was sealed once for every member (``EVERYONE``).
        """
        view = memoryview(blob).cast("B")
        expected = self._received_all[peer] if to_all else self._received[peer]
        if len(view) != len(out) + OVERHEAD:
            self._fail(peer, kind, f"it is {len(view)} bytes, expected {len(out) + OVERHEAD}")
        (seq,) = struct.unpack(">Q", view[:HEADER])
        if seq < expected:
            self._fail(peer, kind, f"it is a replay: sequence {seq}, expected {expected}")
        if seq > expected:
            self._fail(peer, kind, f"it arrived out of order: sequence {seq}, expected {expected}")
        receiver = EVERYONE if to_all else self.me
        try:
            self._aead.decrypt_into(
                _nonce(peer, receiver, seq),
                view[HEADER:],
                self._aad(peer, receiver, kind, seq),
                out,
            )
        except self._invalid_tag:
            self._fail(
                peer,
                kind,
                "it was modified in transit, or sealed with another key (the tag does not verify)",
            )
        if to_all:
            self._received_all[peer] = seq + 1
        else:
            self._received[peer] = seq + 1

    def _aad(self, sender: int, receiver: int, kind: int, seq: int) -> bytes:
        return self._aad_prefix + struct.pack(">HHBQ", sender, receiver, kind, seq)

    def _fail(self, peer: int, kind: int, why: str) -> NoReturn:
        who = self.members[peer].describe()
        me = self.members[self.me].describe()
        raise SecurityError(
            f"the {KIND_NAMES.get(kind, str(kind))} message from {who} to {me} was rejected: "
            f"{why}.\nHINT: something between the ranks altered or injected traffic, or {who} "
            "runs with a different job key; the job stops rather than use the data."
        )


def _nonce(sender: int, receiver: int, seq: int) -> bytes:
    return struct.pack(">HHQ", sender, receiver, seq)


# ---- fault injection (testing only) ----------------------------------------------------------


class _Faults:
    """Planned tampering with this process's outgoing messages. Off unless :func:`inject_fault`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = False
        self._plan: dict[tuple[int, int | None], tuple[str, int]] = {}
        self._counts: dict[tuple[int, int | None], int] = {}
        self._last: dict[tuple[int, int, int], bytes] = {}  # (session, peer, size): a message
        self.held: dict[tuple[int, int], int] = {}

    def set(self, kind: str, sender: int, to: int | None, after: int) -> None:
        with self._lock:
            self._plan[(sender, to)] = (kind, after)
            self._counts[(sender, to)] = 0
            self.active = True

    def clear(self) -> None:
        with self._lock:
            self.__init__()  # type: ignore[misc]

    def take(self, sender: int, peer: int) -> str | None:
        with self._lock:
            for key in ((sender, peer), (sender, None)):
                if key in self._plan:
                    kind, after = self._plan[key]
                    n = self._counts[key]
                    self._counts[key] = n + 1
                    if n == after:
                        del self._plan[key]
                        return kind
        return None

    def remember(self, session: int, peer: int, blob: bytes) -> None:
        self._last[(session, peer, len(blob))] = blob

    def replay(self, session: int, peer: int, nbytes: int) -> bytes | None:
        """An earlier message of ``nbytes`` to ``peer`` (a replay must pass the size check)."""
        return self._last.get((session, peer, nbytes))


_faults = _Faults()


def inject_fault(kind: str, sender: int, to: int | None = None, after: int = 0) -> None:
    """TESTING ONLY: tamper with one message this process seals.

    ``kind`` is ``"flip"`` (one ciphertext bit flipped), ``"replay"`` (an earlier message to the
    same peer sent again in its place) or ``"reorder"`` (the message takes its successor's place
    on the wire). ``sender`` is this process's rank within the group, ``to`` the receiver's
    (``None``: any), ``after`` how many matching messages pass untouched first.
    """
    if kind not in ("flip", "replay", "reorder"):
        raise ConfigError(f"fault kind must be 'flip', 'replay' or 'reorder', got {kind!r}")
    _faults.set(kind, sender, to, after)


def clear_faults() -> None:
    """TESTING ONLY: switch fault injection off again."""
    _faults.clear()
