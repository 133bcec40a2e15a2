"""The job's store served in plain Python (runtime/store_server.py), driven through torch's own
TCPStore client: every query a client of this torch sends, the waits, the launcher's lines on
the server's stdin, and that the server imports no torch (the point of it)."""

from __future__ import annotations

import datetime
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

SERVER = [sys.executable, "-m", "ringtrain.runtime.rendezvous_server"]
SECONDS = datetime.timedelta(seconds=10)


@pytest.fixture
def server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(SERVER, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().split()[1])
        yield proc, port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _client(port: int) -> Any:  # torch's stubs lack append, multi_set and bytes values
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=SECONDS)


@pytest.mark.timeout(60)
def test_every_query_of_torchs_client(server: tuple[subprocess.Popen[str], int]) -> None:
    store = _client(server[1])
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 3) == 3 and store.add("n", -1) == 2 and store.get("n") == b"2"
    assert store.check(["a", "n"]) and not store.check(["a", "never"])
    assert store.compare_set("c", "", "x") == b"x"  # a missing key, expected empty: set
    assert store.compare_set("c", "y", "z") == b"x"  # not what it holds: unchanged
    assert store.compare_set("c", "x", "z") == b"z"
    assert store.compare_set("gone", "q", "r") == b"q" and not store.check(["gone"])  # torch's
    store.append("log", "he")
    store.append("log", "llo")
    assert store.get("log") == b"hello"
    store.multi_set(["m1", "m2"], ["v1", "v2"])
    assert store.multi_get(["m1", "m2"]) == [b"v1", b"v2"]
    keys = store.num_keys()
    assert store.delete_key("m1") and not store.delete_key("m1")
    assert store.num_keys() == keys - 1
    big = b"\0\xff" * (3 << 20)  # bytes of any value, longer than one read
    store.set("big", big)
    store.wait(["big"])  # set() returns once sent: a GET on another connection could pass it
    assert store.get("big") == big
    prefixed = dist.PrefixStore("job", store)
    prefixed.set("k", "v")
    assert store.get("job/k") == b"v"


@pytest.mark.timeout(60)
def test_waits_end_when_another_client_sets_the_keys_or_time_out(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    store, other = _client(server[1]), _client(server[1])
    threading.Timer(0.3, lambda: other.set("later", "v")).start()
    t = time.monotonic()
    store.wait(["later"])
    assert 0.2 < time.monotonic() - t < 5
    threading.Timer(0.3, lambda: other.add("counted", 1)).start()
    assert store.get("counted") == b"1"  # get waits for the key
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], datetime.timedelta(seconds=0.5))
    store.set("after", "ok")  # the cancelled wait left the connection usable
    assert store.get("after") == b"ok"
    threading.Timer(0.3, lambda: other.multi_set(["w1", "w2"], ["1", "2"])).start()
    store.wait(["w1", "w2"])


@pytest.mark.timeout(60)
def test_the_launchers_lines_set_and_check_keys_clients_see(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = server
    assert proc.stdin is not None and proc.stdout is not None
    store = _client(port)
    proc.stdin.write("SET ringtrain/elastic/generation 3 [0, 1]\n")
    proc.stdin.flush()
    assert store.get("ringtrain/elastic/generation") == b"3 [0, 1]"
    store.set("ready/1", "1")
    proc.stdin.write("CHECK 7 ready/0 ready/1 ringtrain/elastic/generation\n")  # question 7
    proc.stdin.flush()
    answer = ["HAVE", "7", "ready/1", "ringtrain/elastic/generation"]  # its number, then keys
    assert proc.stdout.readline().split() == answer
    proc.stdin.close()  # the launcher went: the store ends
    assert proc.wait(timeout=10) == 0


@pytest.mark.timeout(60)
def test_a_stranger_on_the_port_is_dropped_and_the_store_goes_on(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    with socket.create_connection(("127.0.0.1", server[1])) as stranger:
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
        stranger.settimeout(5)
        assert stranger.recv(100) == b""  # closed, not answered
    store = _client(server[1])
    store.set("still", "here")
    assert store.get("still") == b"here"


@pytest.mark.timeout(60)
def test_the_server_imports_no_torch() -> None:
    probe = (
        "import sys, os, contextlib\n"
        "from ringtrain.runtime import rendezvous_server\n"
        "with contextlib.redirect_stdout(open(os.devnull, 'w')):\n"
        "    rendezvous_server.main([])  # stdin, the launcher's pipe, is closed: it returns\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], input="", capture_output=True, text=True, timeout=30
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr


@pytest.mark.timeout(60)
def test_a_client_that_stops_reading_holds_back_only_its_own_replies(
    server: tuple[subprocess.Popen[str], int],
) -> None:
    store = _client(server[1])
    big = b"x" * (32 << 20)  # far more than a socket's buffers hold
    store.set("big", big)
    store.wait(["big"])  # set() returns once sent: a GET on another connection could pass it
    with socket.create_connection(("127.0.0.1", server[1])) as stopped:  # a rank stopped mid-read
        key = b"/big"  # torch's clients put "/" before every key
        stopped.sendall(struct.pack("<BI", 0, 0x3C85F7CE))  # VALIDATE, torch's magic number
        stopped.sendall(struct.pack("<BQ", 3, len(key)) + key)  # GET, never read
        time.sleep(0.5)
        t = time.monotonic()
        other = _client(server[1])
        other.set("still", "served")
        assert store.get("still") == b"served"
        assert time.monotonic() - t < 5
        stopped.settimeout(10)  # the reply is whole once read
        got = bytearray()
        while len(got) < 8 + len(big):
            chunk = stopped.recv(1 << 20)
            assert chunk, f"the store closed the reply after {len(got)} bytes"
            got += chunk
        assert got == struct.pack("<Q", len(big)) + big
