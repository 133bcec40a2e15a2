"""The TCP mesh under the enclave transport: in-order messages, clear errors, strangers turned
away. Two members in one process (threads), over loopback, with a HashStore."""

from __future__ import annotations

import datetime
import socket
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringtrain.transport import tcp_mesh
from ringtrain.transport.tcp_mesh import Mesh

TIMEOUT = datetime.timedelta(seconds=20)


def _pair(store: dist.Store | None = None) -> list[Mesh]:
    store = store or dist.HashStore()
    meshes: list[Mesh | None] = [None, None]

    def make(r: int) -> None:
        meshes[r] = Mesh(store, r, 2, TIMEOUT, "127.0.0.1")

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(m is not None for m in meshes)
    return [m for m in meshes if m is not None]


def test_messages_arrive_in_order_both_ways() -> None:
    a, b = _pair()
    try:
        sent = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in (0, 1, 70_000, 3 << 20)]
        works = [a.send([t], 1) for t in sent] + [b.send([t.flip(0)], 0) for t in sent]
        got_b = [torch.empty_like(t) for t in sent]
        got_a = [torch.empty_like(t) for t in sent]
        works += [b.recv([g], 0) for g in got_b] + [a.recv([g], 1) for g in got_a]
        for w in works:
            w.wait()
        assert all(torch.equal(s, g) for s, g in zip(sent, got_b))
        assert all(torch.equal(s.flip(0), g) for s, g in zip(sent, got_a))
    finally:
        a.close()
        b.close()


def test_size_mismatch_and_closed_peer_are_named_errors() -> None:
    a, b = _pair()
    try:
        a.send([torch.zeros(10, dtype=torch.uint8)], 1)
        with pytest.raises(ConnectionError, match="rank 0 sent 10 bytes where 11 were expected"):
            b.recv([torch.empty(11, dtype=torch.uint8)], 0).wait()
        # The link to rank 0 is broken now: every later operation on it fails at once, naming it.
        with pytest.raises(ConnectionError, match="rank 0"):
            b.recv([torch.empty(1, dtype=torch.uint8)], 0).wait()
        c, d = _pair()
        c.close()  # a peer that goes away: the receiver learns which one
        with pytest.raises(ConnectionError, match="rank 0 closed the connection"):
            d.recv([torch.empty(1, dtype=torch.uint8)], 0).wait()
        d.close()
    finally:
        a.close()
        b.close()


def test_a_stranger_is_turned_away_and_the_member_still_joins() -> None:
    store = dist.HashStore()
    result: list[Mesh] = []
    t = threading.Thread(target=lambda: result.append(Mesh(store, 0, 2, TIMEOUT, "127.0.0.1")))
    t.start()
    ip, port, _token = store.get("tcp/0").decode().split(":")
    with socket.create_connection((ip, int(port))) as s:  # knows the address, not the token
        s.sendall(b"RTM1" + b"\0" * 16 + (1).to_bytes(4, "little"))
        assert s.recv(1) == b""  # closed on us
    b = Mesh(store, 1, 2, TIMEOUT, "127.0.0.1")
    t.join(30)
    (a,) = result
    try:
        a.send([torch.ones(3, dtype=torch.uint8)], 1)
        got = torch.empty(3, dtype=torch.uint8)
        b.recv([got], 0).wait()
        assert got.tolist() == [1, 1, 1]
    finally:
        a.close()
        b.close()


def test_a_silent_stranger_is_turned_away_after_the_greeting_time(monkeypatch: Any) -> None:
    # A connection that says nothing held the listener until the group's timeout, and the
    # real member behind it was never accepted.
    monkeypatch.setattr(tcp_mesh, "GREETING_S", 0.5)
    store = dist.HashStore()
    result: list[Mesh] = []
    t = threading.Thread(target=lambda: result.append(Mesh(store, 0, 2, TIMEOUT, "127.0.0.1")))
    t.start()
    ip, port, _token = store.get("tcp/0").decode().split(":")
    with socket.create_connection((ip, int(port))) as silent:
        b = Mesh(store, 1, 2, TIMEOUT, "127.0.0.1")
        t.join(10)
        assert not t.is_alive(), "the member waited behind a silent connection"
        assert silent.recv(1) == b""  # turned away
    (a,) = result
    a.close()
    b.close()
