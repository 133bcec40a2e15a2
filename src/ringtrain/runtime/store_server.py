"""A TCPStore server in plain Python: the job's rendezvous store without importing torch.

``ringtrain run`` hosts each job's store in a child process (:mod:`rendezvous_server`). Serving
it with ``torch.distributed.TCPStore`` cost that process an import of torch, 1.5-2 s of CPU in
every job, for a dictionary behind a socket. This module speaks the same wire protocol to
torch's own ``TCPStore`` clients (the ranks, Gloo's rendezvous), for the queries a client of
torch 2.13 sends (those of 2.4-2.12 are a subset); ``tests/runtime/test_store_server.py``
drives every one of them through torch's client, so a torch whose protocol moved fails there,
not in a job.

The protocol, as torch's client speaks it: a connection's first message is VALIDATE with a
magic number (no reply); then each query is a one-byte type and its arguments, integers in the
machine's byte order (little-endian here) and strings as a 64-bit length and bytes. WAIT
answers only once every key it names is set (or with WAIT_CANCELED after CANCEL_WAIT).
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAGIC = 0x3C85F7CE
(
    VALIDATE,
    SET,
    COMPARE_SET,
    GET,
    ADD,
    CHECK,
    WAIT,
    GETNUMKEYS,
    DELETE_KEY,
    APPEND,
    MULTI_GET,
    MULTI_SET,
    CANCEL_WAIT,
    PING,
) = range(14)
READY, NOT_READY = b"\x00", b"\x01"  # CHECK's answers
STOP_WAITING, WAIT_CANCELED = b"\x00", b"\x01"  # WAIT's and CANCEL_WAIT's
MAX_SAID = 20  # lines about bad connections written to stderr, at most
MAX_KEYS = 128 * 1024  # keys in one CHECK, WAIT or MULTI_* query (torch's own bound)


class _Short(Exception):
    """The query is not all here yet: read more and parse it again from its start."""


class ProtocolError(Exception):
    """The peer sent what no torch client sends: its connection is closed."""


class _Reader:
    """Parses one query out of a connection's buffered bytes."""

    def __init__(self, data: bytearray) -> None:
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise _Short
        out = bytes(self.data[self.at : self.at + n])
        self.at += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def i64(self) -> int:
        return int(struct.unpack("<q", self.take(8))[0])

    def blob(self) -> bytes:
        return self.take(self.u64())

    def count(self) -> int:
        n = self.u64()
        if n > MAX_KEYS:
            raise ProtocolError(f"{n} keys in one query (at most {MAX_KEYS})")
        return n


def _blob(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    inbox: bytearray = field(default_factory=bytearray)
    # Replies its socket has not taken yet, in order; a view's slice is what is left of it
    # (no copy of a large value per partial send).
    outbox: deque[memoryview] = field(default_factory=deque)
    validated: bool = False
    awaited: set[bytes] = field(default_factory=set)  # keys its WAIT still lacks


class StoreServer:
    """The store: a dict of bytes served to torch's TCPStore clients from one thread."""

    def __init__(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.listener = listener
        self.data: dict[bytes, bytes] = {}
        self.waiting: dict[bytes, list[_Client]] = {}  # key -> clients whose WAIT lacks it
        self.selector = selectors.DefaultSelector()
        self._said = 0  # connections closed for a bad query, counted
        self.selector.register(listener, selectors.EVENT_READ, lambda _: self._accept())

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    # The store's operations, shared by the socket queries and the launcher's lines.
    def set(self, key: bytes, value: bytes) -> None:
        self.data[key] = value
        self._wake(key)

    def check(self, keys: list[bytes]) -> bool:
        return all(k in self.data for k in keys)

    def _wake(self, key: bytes) -> None:
        for client in self.waiting.pop(key, []):
            client.awaited.discard(key)
            if not client.awaited:
                self._send(client, STOP_WAITING)

    def _forget_waits(self, client: _Client) -> None:
        for key in client.awaited:
            waiters = self.waiting.get(key, [])
            if client in waiters:
                waiters.remove(client)
            if not waiters:
                self.waiting.pop(key, None)
        client.awaited.clear()

    # The loop.
    def watch(self, fd: int, on_line: Callable[[bytes], None]) -> None:
        """Also read lines from ``fd`` (the launcher's pipe), raw: a buffered reader could hold
        lines the selector never reports. :meth:`serve` ends when ``fd`` ends."""
        pending = bytearray()

        def read(_events: int) -> None:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._open = False
                return
            pending.extend(chunk)
            while b"\n" in pending:
                line, _, rest = bytes(pending).partition(b"\n")
                pending[:] = rest
                on_line(line)

        self.selector.register(fd, selectors.EVENT_READ, read)

    def serve(self) -> None:
        """Serve until the watched stream ends (forever if none is watched)."""
        self._open = True
        while self._open:
            for key, events in self.selector.select():
                key.data(events)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        # Non-blocking: a client that stops reading (a rank stopped mid-reply) holds back only
        # its own replies, never the store.
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        client = _Client(sock)
        self.selector.register(sock, selectors.EVENT_READ, lambda ev: self._ready(client, ev))

    def _ready(self, client: _Client, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(client)
        if events & selectors.EVENT_READ and client.sock.fileno() >= 0:
            self._read(client)

    def _read(self, client: _Client) -> None:
        try:
            chunk = client.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(client)
            return
        client.inbox += chunk
        try:
            while client.inbox:
                reader = _Reader(client.inbox)
                try:
                    self._query(client, reader)
                except _Short:
                    return
                del client.inbox[: reader.at]
        except Exception as e:  # one client's bad query must not end the job's store
            self._said += 1
            if self._said <= MAX_SAID:  # the launcher reads this pipe only if the store fails
                print(f"ringtrain store: closing a connection: {e}", file=sys.stderr, flush=True)
            self._close(client)

    def _close(self, client: _Client) -> None:
        if client.sock.fileno() < 0:
            return  # closed already
        self._forget_waits(client)
        client.outbox.clear()
        self.selector.unregister(client.sock)
        client.sock.close()

    def _send(self, client: _Client, data: bytes) -> None:
        """Queue a reply behind the client's others; what its socket takes now goes at once."""
        client.outbox.append(memoryview(data))
        if len(client.outbox) == 1:
            self._flush(client)

    def _flush(self, client: _Client) -> None:
        """Send queued replies until the socket would block; then ask the selector to say when
        it can take more (and stop asking once the queue is empty)."""
        if client.sock.fileno() < 0:
            return
        box = client.outbox
        try:
            while box:
                sent = client.sock.send(box[0])
                if sent < len(box[0]):
                    box[0] = box[0][sent:]
                    break
                box.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # it left: its read end sees that and closes it
            box.clear()
        wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if box else 0)
        if self.selector.get_key(client.sock).events != wanted:
            self.selector.modify(client.sock, wanted, lambda ev: self._ready(client, ev))

    def _query(self, client: _Client, r: _Reader) -> None:
        kind = r.u8()
        if not client.validated:
            if kind != VALIDATE or r.u32() != MAGIC:
                raise ProtocolError("a connection did not open as a torch TCPStore client")
            client.validated = True
        elif kind == SET:
            key, value = r.blob(), r.blob()
            self.set(key, value)
        elif kind == COMPARE_SET:
            key, expected, new = r.blob(), r.blob(), r.blob()
            self._send(client, _blob(self._compare_set(key, expected, new)))
        elif kind == GET:
            self._send(client, _blob(self.data.get(r.blob(), b"")))
        elif kind == ADD:
            key, delta = r.blob(), r.i64()
            try:
                total = delta + int(self.data.get(key, b"0"))
            except ValueError:
                raise ProtocolError(f"add() to {key!r}, whose value is not a number") from None
            self.set(key, str(total).encode())
            self._send(client, struct.pack("<q", total))
        elif kind == CHECK:
            keys = [r.blob() for _ in range(r.count())]
            self._send(client, READY if self.check(keys) else NOT_READY)
        elif kind == WAIT:
            self._wait(client, [r.blob() for _ in range(r.count())])
        elif kind == GETNUMKEYS:
            self._send(client, struct.pack("<q", len(self.data)))
        elif kind == DELETE_KEY:
            found = self.data.pop(r.blob(), None) is not None
            self._send(client, struct.pack("<q", int(found)))
        elif kind == APPEND:
            key, value = r.blob(), r.blob()
            self.set(key, self.data.get(key, b"") + value)
        elif kind == MULTI_GET:
            keys = [r.blob() for _ in range(r.count())]
            self._send(client, b"".join(_blob(self.data.get(k, b"")) for k in keys))
        elif kind == MULTI_SET:
            pairs = [(r.blob(), r.blob()) for _ in range(r.count())]
            for key, value in pairs:
                self.set(key, value)
        elif kind == CANCEL_WAIT:
            self._forget_waits(client)
            self._send(client, WAIT_CANCELED)
        elif kind == PING:
            self._send(client, struct.pack("<I", r.u32()))
        else:
            raise ProtocolError(
                f"query type {kind}, which ringtrain's store server does not know (a torch "
                "newer than the protocol it speaks, torch 2.13's?)"
            )

    def _compare_set(self, key: bytes, expected: bytes, new: bytes) -> bytes:
        """torch's rule: a missing key is set only where ``expected`` is empty; the answer is
        the value now held (``expected`` for a missing key left unset)."""
        current = self.data.get(key)
        if current is None:
            if expected:
                return expected
            self.set(key, new)
            return new
        if current == expected:
            self.set(key, new)
            return new
        return current

    def _wait(self, client: _Client, keys: list[bytes]) -> None:
        missing = {k for k in keys if k not in self.data}
        if not missing:
            self._send(client, STOP_WAITING)
            return
        client.awaited = missing
        for key in missing:
            self.waiting.setdefault(key, []).append(client)
