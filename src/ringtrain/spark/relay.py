"""The ranks' output of ``ringtrain.spark.run``, line by line from the Spark tasks to the driver.

Horovod streams what its Spark ranks print to the driver as they print it; so does this. The
driver listens on its own Spark address (``spark.driver.host``, which every executor reaches
already for Spark's own traffic); each task connects back, sends the run's token and its rank,
then one JSON line ``[fd, time read, text]`` per line its rank prints. The token (random, made
per run, shipped to the tasks inside the task's closure as the function itself is) keeps other
processes from writing into the driver's output. Where a task cannot connect (a firewall
between the executors and the driver), it keeps its lines and returns them with its result, and
the driver writes them once the ranks have ended.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from ringtrain.launch.rank_output import stamp

Line = tuple[int, float, str]  # (1 | 2, when its task read it, the line)
log = logging.getLogger("ringtrain")

# A task gives up connecting after this long and keeps its lines; once connected, a driver that
# reads nothing for this long is taken as gone (the rank is not held up by its output). A
# connection that has not said who it is within HELLO_S is dropped (not one of the tasks).
CONNECT_S, STALLED_S, HELLO_S = 5.0, 60.0, 10.0


@dataclass(frozen=True)
class Address:
    """What a task needs to reach the driver's relay (travels with the task, pickled)."""

    host: str
    port: int
    token: str


class Relay:
    """The driver's end: writes each rank's lines to ``stdout``/``stderr`` as they arrive.
    ``address`` is None where the driver cannot listen on ``bind``: the tasks then keep their
    lines, written when the ranks have ended (the job itself is not failed for its output)."""

    def __init__(
        self,
        bind: str,
        advertise: str,
        stdout: IO[str] | None,
        stderr: IO[str] | None,
        timestamps: bool,
    ) -> None:
        self._streams = {1: stdout, 2: stderr}
        self._timestamps = timestamps
        self._lock = threading.Lock()  # one line at a time, whichever task sent it
        self._closing = threading.Event()
        self._drain_until = 0.0  # set by close(): how long connections still being made are taken
        self._closed = False  # past close(): a reader still under way writes nothing more
        self._readers: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self.address: Address | None = None
        self._token = secrets.token_hex(16)
        try:
            self._server = socket.create_server((bind, 0))
        except OSError as e:
            log.warning(
                "ringtrain.spark.run: cannot listen on %s for the ranks' output (%s): it is "
                "written when the ranks have ended. HINT: check spark.driver.bindAddress.",
                bind,
                e,
            )
            return
        self._server.settimeout(0.2)  # how often the accepting thread looks at _closing
        self.address = Address(advertise, self._server.getsockname()[1], self._token)
        self._accepting.start()

    def write_kept(self, rank: int, lines: list[Line]) -> None:
        """Lines a task could not send (it returned them with its result)."""
        for fd, when, text in lines:
            self._write(rank, fd, when, text, streamed=False)

    def _write(self, rank: int, fd: int, when: float, text: str, streamed: bool) -> None:
        stream = self._streams.get(fd)
        with self._lock:
            if stream is None or (streamed and self._closed):
                return
            stream.write(f"{stamp(when) if self._timestamps else ''}[{rank}] {text}\n")
            stream.flush()  # it is meant to be seen now

    def close(self, wait_s: float = 10.0) -> None:
        """Stop accepting, and give each task's stream ``wait_s`` to deliver what is under way
        (the tasks have ended when Spark's job has, so their connections are closing)."""
        self._drain_until = time.monotonic() + 1.0
        self._closing.set()
        if self.address is not None:
            self._accepting.join()
            self._server.close()
        deadline = time.monotonic() + wait_s
        for reader in self._readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._closed = True

    def _accept(self) -> None:
        while True:
            # Read before waiting: a task that connected just before close() is still taken,
            # for a second (connections that keep coming do not hold close() up).
            closing = self._closing.is_set()
            if closing and time.monotonic() > self._drain_until:
                return
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                if closing:
                    return
                continue
            except OSError:
                return
            reader = threading.Thread(target=self._read, args=(conn,), daemon=True)
            self._readers.append(reader)
            reader.start()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(HELLO_S)
        with conn, conn.makefile("r", encoding="utf-8", errors="replace") as f:
            try:
                rank = self._hello(f.readline())
            except OSError:  # silent past HELLO_S
                return
            if rank is None:
                return  # not one of this run's tasks: nothing it sends is written
            conn.settimeout(None)  # a rank may print nothing for hours
            for raw in f:
                with contextlib.suppress(ValueError, TypeError):
                    fd, when, text = json.loads(raw)
                    self._write(rank, int(fd), float(when), str(text), streamed=True)

    def _hello(self, line: str) -> int | None:
        try:
            hello: Any = json.loads(line)
            token, rank = str(hello["token"]), int(hello["rank"])
        except (ValueError, TypeError, KeyError):
            return None
        return rank if hmac.compare_digest(token, self._token) else None


class Sender:
    """A task's end: each line to the driver as it is read, or kept where the driver cannot be
    reached (``kept`` then goes back with the task's result)."""

    def __init__(self, address: Address | None, rank: int) -> None:
        self.kept: list[Line] = []
        self._lock = threading.Lock()  # the rank's stdout and stderr readers share the socket
        self._sock: socket.socket | None = None
        if address is None:
            return
        try:
            self._sock = socket.create_connection((address.host, address.port), CONNECT_S)
            self._sock.settimeout(STALLED_S)
            self._sock.sendall(_json({"token": address.token, "rank": rank}))
        except OSError:
            self._drop()

    def line(self, fd: int, when: float, text: str) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.sendall(_json([fd, when, text]))
                    return
                except OSError:  # the driver stopped reading: keep this line and the rest
                    self._drop()
            self.kept.append((fd, when, text))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_WR)
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None


def _json(value: object) -> bytes:
    return (json.dumps(value) + "\n").encode()
