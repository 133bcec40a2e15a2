"""A small TCP link test between two hosts: latency by round trips, bandwidth by a timed stream.

The receiver (:func:`serve`) listens on the address the job would use; a sender (:func:`measure`)
on another host opens two connections to it:

- ``L``: latency. ``rtts`` messages of 64 bytes, each echoed back (``TCP_NODELAY`` on both
  ends); the median round trip is the figure, the minimum is kept too.
- ``B``: bandwidth. The sender streams zeros; the receiver counts the bytes that arrive during a
  window that starts at the first byte, then sends back one line with the count and the time.
  Counting at the receiver measures what crossed the link, not what filled the sender's socket
  buffer, and the window ends the test even on a 10 Mbit/s link with megabytes buffered.

No torch, nothing outside the standard library: it runs wherever Python does.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import statistics
import struct
import sys
import threading
import time
from typing import IO, Any

from ringtrain.doctor.wire import emit

MSG = 64
CHUNK = 1 << 20
DRAIN_S = 5.0


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise ConnectionError(f"the peer closed the connection after {len(buf)} of {n} bytes")
        buf += got
    return buf


# ---- receiver ---------------------------------------------------------------------------------


def _echo(conn: socket.socket) -> None:
    while True:
        data = conn.recv(4096)
        if not data:
            return
        conn.sendall(data)


def _count(conn: socket.socket) -> None:
    (window_ms,) = struct.unpack("!I", _recv_exact(conn, 4))
    window = window_ms / 1000
    buf = bytearray(CHUNK)
    conn.settimeout(window + 30)
    first = last = 0.0
    total = 0
    while True:
        n = conn.recv_into(buf)
        now = time.perf_counter()
        if n == 0:
            break
        if not first:
            first = last = now  # the first chunk only starts the clock
            continue
        total += n
        last = now
        if now - first >= window:
            break
    report = {"bytes": total, "seconds": last - first}
    conn.sendall((json.dumps(report) + "\n").encode())
    # Read until the sender closes: closing with unread data would reset the connection and
    # could destroy the report before the sender reads it.
    conn.settimeout(DRAIN_S)
    with contextlib.suppress(OSError):
        while conn.recv_into(buf):
            pass


def _handle(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(60)
        try:
            mode = _recv_exact(conn, 1)
            if mode == b"L":
                _echo(conn)
            elif mode == b"B":
                _count(conn)
        except (OSError, ConnectionError):
            pass  # the sender reports what it saw


def serve(
    bind: str, lifetime_s: float, out: IO[str] = sys.stdout, stdin: IO[str] = sys.stdin
) -> int:
    """Listen on ``bind`` (port chosen by the kernel), announce the port, serve until stdin
    closes (the doctor's lifeline) or ``lifetime_s`` passes."""
    try:
        server = socket.create_server((bind, 0), backlog=16)
    except OSError as e:
        emit(out, {"error": f"cannot listen on {bind}: {e.strerror or e}"})
        return 1
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_handle, args=(conn,), daemon=True).start()

    def lifeline() -> None:
        for _ in stdin:
            pass
        done.set()

    threading.Thread(target=accept, daemon=True).start()
    threading.Thread(target=lifeline, daemon=True).start()
    emit(out, {"address": bind, "port": server.getsockname()[1]})
    done.wait(lifetime_s)
    done.set()
    server.close()
    return 0


# ---- sender -----------------------------------------------------------------------------------


def _latency(address: str, port: int, rtts: int, timeout: float) -> dict[str, float]:
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"L")
        msg = b"x" * MSG
        samples = []
        for _ in range(rtts):
            t0 = time.perf_counter()
            conn.sendall(msg)
            _recv_exact(conn, MSG)
            samples.append(time.perf_counter() - t0)
    return {"rtt_s": statistics.median(samples), "rtt_min_s": min(samples)}


def _bandwidth(address: str, port: int, seconds: float, timeout: float) -> dict[str, float]:
    with socket.create_connection((address, port), timeout=timeout) as conn:
        conn.sendall(b"B" + struct.pack("!I", int(seconds * 1000)))
        conn.setblocking(False)
        payload = memoryview(bytes(CHUNK))
        deadline = time.monotonic() + seconds + timeout + 30
        reply = b""
        while b"\n" not in reply:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no report from the receiver within {seconds + timeout + 30:.0f} s"
                )
            readable, writable, _ = select.select(
                [conn], [] if reply else [conn], [], min(left, 1.0)
            )
            if readable:
                got = conn.recv(4096)
                if not got:
                    raise ConnectionError("the receiver closed the connection without a report")
                reply += got
            elif writable:
                with contextlib.suppress(BlockingIOError):
                    conn.send(payload)
        # Drop what is still queued: left to drain, it would delay the next measurement
        # from this host (megabytes at 10 Mbit/s take seconds).
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    report = json.loads(reply.split(b"\n", 1)[0])
    secs = float(report["seconds"])
    rate = float(report["bytes"]) / secs if secs > 0 else 0.0
    return {"bytes": float(report["bytes"]), "seconds": secs, "bytes_per_s": rate}


def measure(
    address: str, port: int, seconds: float, rtts: int, timeout: float = 10.0
) -> dict[str, Any]:
    """Latency and bandwidth from here to a receiver; ``{"error": ...}`` when it fails."""
    result: dict[str, Any] = {"address": address, "port": port}
    try:
        result.update(_latency(address, port, rtts, timeout))
        result.update(_bandwidth(address, port, seconds, timeout))
    except (OSError, ConnectionError, ValueError, KeyError) as e:
        what = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        result["error"] = f"{address}:{port}: {what}"
    return result
