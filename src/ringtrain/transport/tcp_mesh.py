"""Point-to-point messages between the members of a group over plain TCP sockets.

This is the wire under ringtrain's own ring algorithms (:class:`ringtrain.transport.ring.Ring`)
when a job runs with ``transport = "tcp"``, in place of a Gloo group. It exists for enclaves:
Gloo's TCP device calls ``getifaddrs()`` (netlink) even when given an address, and enclave
runtimes such as Gramine have no netlink. What a :class:`Mesh` does, and does not do:

* one TCP connection per pair of members, bound to an address given by the caller (no interface
  enumeration, no name resolution: numeric IPv4 only), found through the group's store (each
  member posts ``address:port:token``; the higher rank connects to the lower and proves it read
  the token, so a stray connection is turned away instead of taking a member's place);
* ``send``/``recv`` of uint8 tensors, matched in order per pair (the order the caller posts
  them), each message framed with its length so a mismatch is an error, not garbled data;
* two Python threads per peer (one sends, one receives): a large message overlaps the next, and
  sockets release the GIL while they move bytes. They touch no tensor outside
  :func:`ringtrain.runtime.exit_guard.native_call` (the caller makes each message's view; the
  thread frees it inside one), so none can abort the process while it exits;
* nothing an enclave lacks: no netlink, no ``MSG_MORE`` (``TCP_NODELAY`` and one ``sendmsg`` of
  header and payload instead), no ``fork``, no file locks, no shared memory, no signals.

A peer that closes its connection, or a wait longer than the group's timeout, fails the pending
and every later operation to that peer with :class:`ConnectionError` naming it. Integrity and
confidentiality are not this module's business: the sealed backend seals what it sends.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

import torch

from ringtrain.runtime import exit_guard
from ringtrain.runtime.contracts import Store

log = logging.getLogger("ringtrain")

# How long closing a mesh waits for its peers' threads to end (they end as their sockets shut).
CLOSE_JOIN_S = 2.0
# How long an accepted connection has to say who it is. A member sends its greeting as soon as
# it connects; a connection that stays silent (anyone who read the address in the store) is
# turned away after this, so it cannot hold the listener until the group's timeout.
GREETING_S = 10.0
_MAGIC = b"RTM1"
_HELLO = struct.Struct("<4s16sI")  # magic, the listener's token, the connecting rank
_HEADER = struct.Struct("<Q")  # payload length


class MeshWork:
    """One send or receive; ``wait`` raises its error."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


# A message to move: the bytes of its tensor (a view that keeps the tensor alive), its handle.
_Job = tuple[memoryview, MeshWork]


def _bytes_of(t: torch.Tensor) -> memoryview:
    if t.dtype != torch.uint8 or not t.is_contiguous() or t.device.type != "cpu":
        raise TypeError("the TCP mesh moves contiguous uint8 CPU tensors only")
    return memoryview(t.numpy()).cast("B") if t.numel() else memoryview(b"")  # type: ignore[arg-type]


class _Peer:
    """The connection to one member, with its sending and receiving threads."""

    def __init__(self, sock: socket.socket, me: int, peer: int, timeout_s: float) -> None:
        self.sock = sock
        self.peer = peer
        self.error: BaseException | None = None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout_s)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._sends: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._recvs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._loop, args=(self._sends, self._send), daemon=True,
                             name=f"ringtrain-tcp-{me}>{peer}"),
            threading.Thread(target=self._loop, args=(self._recvs, self._recv), daemon=True,
                             name=f"ringtrain-tcp-{me}<{peer}"),
        ]  # fmt: skip
        for t in self.threads:
            t.start()

    def post_send(self, t: torch.Tensor) -> MeshWork:
        return self._post(self._sends, t)

    def post_recv(self, t: torch.Tensor) -> MeshWork:
        return self._post(self._recvs, t)

    def _post(self, jobs: queue.SimpleQueue[_Job | None], t: torch.Tensor) -> MeshWork:
        # The bytes' view is made here, on the caller's thread: Tensor.numpy() releases the
        # GIL, which the peer's daemon threads must not do outside a native call. The view
        # keeps the tensor alive until the message has moved.
        data = _bytes_of(t)
        work = MeshWork()
        with self._lock:  # a job queued behind close()'s stop would never finish
            if self._closed:
                work.finish(ConnectionError(f"the connection to rank {self.peer} was closed"))
            else:
                jobs.put((data, work))
        return work

    def _loop(
        self, jobs: queue.SimpleQueue[_Job | None], move: Callable[[memoryview], object]
    ) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            data, work = job
            del job
            error = self.error
            if error is None:
                try:
                    move(data)
                except TimeoutError:
                    error = self.error = ConnectionError(
                        f"no progress with rank {self.peer} for {self._timeout_s:g} s (the "
                        "group's timeout): it may be stuck or gone"
                    )
                except (OSError, ValueError) as e:
                    error = self.error = ConnectionError(
                        f"the connection to rank {self.peer} failed: {e}"
                    )
            # The view may hold the tensor's last reference (its caller gave up on it): it is
            # freed inside a native call, or kept if the process is exiting (runtime.exit_guard).
            with exit_guard.native_call() as ok:
                if not ok:
                    exit_guard.keep(data)
                    error = error or ConnectionError("the process is exiting")
                del data
                work.finish(error)
                del work
            if not ok:
                return

    def _send(self, data: memoryview) -> None:
        header = _HEADER.pack(len(data))
        sent = self.sock.sendmsg([header, data]) if len(data) else self.sock.send(header)
        if sent < len(header):
            self.sock.sendall(header[sent:])
            sent = len(header)
        if sent - len(header) < len(data):
            self.sock.sendall(data[sent - len(header) :])

    def _recv(self, data: memoryview) -> None:
        header = bytearray(_HEADER.size)
        self._recv_into(memoryview(header))
        (n,) = _HEADER.unpack(header)
        if n != len(data):
            raise ValueError(f"rank {self.peer} sent {n} bytes where {len(data)} were expected")
        self._recv_into(data)

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:], len(view) - got)
            if n == 0:
                raise OSError(f"rank {self.peer} closed the connection")
            got += n

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._sends.put(None)
            self._recvs.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Mesh:
    """Connections from this member to every other member of one group.

    Collective: every member creates its mesh with the same store, at about the same time.
    ``address`` is this host's numeric IPv4 address that the other members can reach.
    """

    def __init__(
        self, store: Store, rank: int, size: int, timeout: datetime.timedelta, address: str
    ) -> None:
        self.rank, self.size = rank, size
        timeout_s = timeout.total_seconds()
        self._peers: dict[int, _Peer] = {}
        if size == 1:
            return
        token = os.urandom(16)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((address, 0))
            listener.listen(size)
            listener.settimeout(timeout_s)
            port = listener.getsockname()[1]
            store.set(f"tcp/{rank}", f"{address}:{port}:{token.hex()}")
            # Connect to the lower ranks (their listeners queue us until they accept), then
            # accept the higher ones: no order of arrival can deadlock.
            for peer in range(rank):
                self._peers[peer] = _Peer(
                    self._connect(store, peer, timeout_s), rank, peer, timeout_s
                )
            deadline = time.monotonic() + timeout_s
            while len(self._peers) < size - 1:
                listener.settimeout(max(deadline - time.monotonic(), 0.001))
                sock, _ = listener.accept()
                sock.settimeout(min(GREETING_S, max(deadline - time.monotonic(), 0.001)))
                joiner = self._admit(sock, token)
                if joiner is not None:
                    self._peers[joiner] = _Peer(sock, rank, joiner, timeout_s)
        except TimeoutError:
            missing = sorted(set(range(size)) - set(self._peers) - {rank})
            self.close()
            raise ConnectionError(
                f"rank {rank} could not connect to ranks {missing} within {timeout_s:g} s"
            ) from None
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()

    def _connect(self, store: Store, peer: int, timeout_s: float) -> socket.socket:
        ip, port, token = store.get(f"tcp/{peer}").decode().split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect((ip, int(port)))
            sock.sendall(_HELLO.pack(_MAGIC, bytes.fromhex(token), self.rank))
        except OSError as e:
            sock.close()
            raise ConnectionError(
                f"rank {self.rank} could not connect to rank {peer} at {ip}:{port}: {e}"
            ) from e
        return sock

    def _admit(self, sock: socket.socket, token: bytes) -> int | None:
        """The connecting member's rank, or None (and the socket closed) for a stranger."""
        try:
            hello = bytearray(_HELLO.size)
            view, got = memoryview(hello), 0
            while got < len(hello):
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise OSError("closed before saying who it is")
                got += n
            magic, their_token, peer = _HELLO.unpack(hello)
            if magic != _MAGIC or their_token != token:
                raise OSError("wrong greeting")
            if not self.rank < peer < self.size or peer in self._peers:
                raise OSError(f"claims rank {peer}")
            return int(peer)
        except OSError as e:
            log.warning("rank %d turned away a connection: %s", self.rank, e)
            sock.close()
            return None

    def _peer(self, peer: int) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            raise ValueError(f"rank {peer} is not another member of this {self.size}-member group")
        return p

    # The calls Ring makes on a Gloo group: send([t], peer, tag) / recv([t], peer, tag).
    def send(self, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> MeshWork:
        (t,) = tensors
        return self._peer(peer).post_send(t)

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int = 0) -> MeshWork:
        (t,) = tensors
        return self._peer(peer).post_recv(t)

    def close(self) -> None:
        peers = list(self._peers.values())
        self._peers.clear()
        for p in peers:
            p.close()
        # Let the peers' threads end now, not while the interpreter exits (a thread still
        # winding down then can abort the process: runtime.exit_guard). Called from a peer's
        # own thread it cannot wait for that one.
        deadline = time.monotonic() + CLOSE_JOIN_S
        me = threading.current_thread()
        for p in peers:
            for t in p.threads:
                if t is not me:
                    t.join(max(0.0, deadline - time.monotonic()))
                    if t.is_alive():  # a busy machine: the process's exit waits for it
                        exit_guard.leave_behind(t)
