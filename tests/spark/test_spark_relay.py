"""The driver's relay of ``ringtrain.spark.run``: each task's lines reach the driver's streams
as they are printed, only from tasks holding the run's token, and a task that cannot reach the
driver keeps its lines for its result (no Spark needed: the tasks' ends run in threads here)."""

from __future__ import annotations

import io
import json
import logging
import socket
import time
from collections.abc import Callable

import pytest

from ringtrain.spark import relay as relay_module
from ringtrain.spark.relay import Address, Relay, Sender


def _until(predicate: Callable[[], bool], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_each_line_is_written_when_it_arrives_prefixed_by_its_rank() -> None:
    out, err = io.StringIO(), io.StringIO()
    relay = Relay("127.0.0.1", "127.0.0.1", out, err, timestamps=False)
    try:
        zero, one = Sender(relay.address, 0), Sender(relay.address, 1)
        zero.line(1, time.time(), "first")
        # Written while both tasks still run: streamed, not held until they end.
        assert _until(lambda: out.getvalue() == "[0] first\n"), out.getvalue()
        one.line(2, time.time(), "a warning")
        one.line(1, time.time(), "second")
        assert _until(lambda: "[1] second" in out.getvalue()), out.getvalue()
        assert err.getvalue() == "[1] a warning\n"
        zero.close()
        one.close()
    finally:
        relay.close()
    assert out.getvalue() == "[0] first\n[1] second\n"
    assert zero.kept == [] and one.kept == []


def test_the_time_a_task_read_a_line_is_its_stamp() -> None:
    out = io.StringIO()
    relay = Relay("127.0.0.1", "127.0.0.1", out, None, timestamps=True)
    read_at = time.mktime((2026, 12, 3, 12, 49, 33, 0, 0, -1)) + 0.983
    sender = Sender(relay.address, 3)
    sender.line(1, read_at, "hello")
    sender.line(2, read_at, "to a stream not given: dropped")
    sender.close()
    relay.close()
    assert out.getvalue() == "2026-12-03 12:49:33.983 [3] hello\n"


def test_a_connection_without_the_runs_token_writes_nothing() -> None:
    out = io.StringIO()
    relay = Relay("127.0.0.1", "127.0.0.1", out, out, timestamps=False)
    try:
        forged = Sender(Address("127.0.0.1", relay.address.port, "0" * 32), 0)
        forged.line(1, time.time(), "injected")
        with socket.create_connection(("127.0.0.1", relay.address.port)) as raw:
            raw.sendall(b"not json\n" + json.dumps([1, 0.0, "also injected"]).encode() + b"\n")
        forged.close()
        honest = Sender(relay.address, 1)
        honest.line(1, time.time(), "mine")
        honest.close()
    finally:
        relay.close()
    assert out.getvalue() == "[1] mine\n"


def test_a_task_that_cannot_reach_the_driver_keeps_its_lines() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # closed below: nothing listens there
    sender = Sender(Address("127.0.0.1", port, "t"), 0)
    sender.line(1, 5.0, "kept")
    sender.line(2, 6.0, "kept too")
    sender.close()
    assert sender.kept == [(1, 5.0, "kept"), (2, 6.0, "kept too")]
    # They travel with the task's result; the driver writes them once the ranks have ended.
    out, err = io.StringIO(), io.StringIO()
    relay = Relay("127.0.0.1", "127.0.0.1", out, err, timestamps=False)
    relay.close()
    relay.write_kept(0, sender.kept)
    assert (out.getvalue(), err.getvalue()) == ("[0] kept\n", "[0] kept too\n")


def test_lines_after_the_driver_went_away_are_kept() -> None:
    with socket.create_server(("127.0.0.1", 0)) as driver:
        sender = Sender(Address("127.0.0.1", driver.getsockname()[1], "t"), 0)
        conn, _ = driver.accept()
        conn.close()  # the driver is gone: its end of the stream closed
    # The first sends may still reach the kernel's buffer; once the peer's reset is back, every
    # later line is kept, in order.
    sent = 0
    while not sender.kept and sent < 1000:
        sender.line(1, float(sent), f"line {sent}")
        sent += 1
        time.sleep(0.001)
    sender.line(1, -1.0, "last")
    sender.close()
    assert sender.kept and sender.kept[-1] == (1, -1.0, "last")
    first = int(sender.kept[0][2].split()[1])
    assert [t for _, _, t in sender.kept] == [f"line {n}" for n in range(first, sent)] + ["last"]


def test_a_connection_that_never_says_who_it_is_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay_module, "HELLO_S", 0.3)  # 10 s in a run
    out = io.StringIO()
    relay = Relay("127.0.0.1", "127.0.0.1", out, None, timestamps=False)
    with socket.create_connection(("127.0.0.1", relay.address.port)) as silent:
        honest = Sender(relay.address, 0)
        honest.line(1, time.time(), "mine")
        honest.close()
        # Dropped by the relay once HELLO_S has passed: its end of the socket reads EOF.
        silent.settimeout(5.0)
        assert silent.recv(1) == b""
        began = time.monotonic()
        relay.close()  # nothing left to wait for: the silent reader has ended
        assert time.monotonic() - began < 3.0
    assert out.getvalue() == "[0] mine\n"


def test_a_driver_that_cannot_listen_writes_the_kept_lines_at_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    out = io.StringIO()
    # 203.0.113.77 (TEST-NET-3) is no address of this machine: binding fails, nothing is sent.
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        relay = Relay("203.0.113.77", "203.0.113.77", out, None, timestamps=False)
    assert relay.address is None
    assert "cannot listen on 203.0.113.77" in caplog.text and "HINT" in caplog.text
    sender = Sender(relay.address, 0)  # what each task is then given: keep the lines
    sender.line(1, 1.0, "at the end")
    sender.close()
    relay.close()
    relay.write_kept(0, sender.kept)
    assert out.getvalue() == "[0] at the end\n"
