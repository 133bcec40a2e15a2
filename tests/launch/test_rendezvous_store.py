"""The launcher's rendezvous store: its port is the launcher's from the moment it is chosen."""

from __future__ import annotations

import datetime
import errno
import socket
import sys
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from ringtrain.errors import LaunchError
from ringtrain.launch.rendezvous import RendezvousServer


@pytest.mark.timeout(60)
def test_the_port_is_never_free_between_choosing_and_serving() -> None:
    # The ranks are given the port before the server has started. A port found free and
    # bound by the server later was once taken meanwhile (EADDRINUSE, the job failed to start);
    # now the socket is bound and listening before the server starts, and the server serves it.
    server = RendezvousServer(sys.executable, timeout_s=30.0, start_timeout_s=30.0)
    try:
        port = server.chosen_port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
            with pytest.raises(OSError) as taken:
                other.bind(("", port))
            assert taken.value.errno == errno.EADDRINUSE
        # A rank that connects before the server is up waits in the backlog, then is served.
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )
        assert server.port == port
        server.publish("ringtrain/test", "here")
        assert client.get("ringtrain/test") == b"here"
        assert server.present(["ringtrain/test", "absent"]) == {"ringtrain/test"}
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_late_answer_is_never_taken_for_a_later_questions() -> None:
    """The launcher asks the store in turn about re-form requests and joiners' ready keys. An
    answer that comes after its question gave up (a busy store) was read as the next
    question's answer, and so on: every answer one behind, the joiners' keys never seen."""
    server = RendezvousServer(sys.executable, timeout_s=30.0, start_timeout_s=30.0)
    try:
        assert server.port
        server.publish("ringtrain/a", "1")
        server.publish("ringtrain/b", "1")
        store = psutil.Process(server._proc.pid)
        store.suspend()  # the busy store: it answers only after the question gave up
        try:
            assert server.present(["ringtrain/a"], timeout_s=0.2) == set()
        finally:
            store.resume()
        assert server.present(["ringtrain/b", "ringtrain/c"]) == {"ringtrain/b"}
        assert server.present(["ringtrain/a", "ringtrain/c"]) == {"ringtrain/a"}
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_store_slower_than_the_start_timeout_says_which_flag_to_raise(tmp_path: Path) -> None:
    """A busy host starts the store slowly: the error names --start-timeout, not a missing
    ringtrain. (The store starts in a fraction of a second: an interpreter that first sleeps
    stands for the busy host.)"""
    slow = tmp_path / "slow-python"
    slow.write_text(  # one process, which the launcher's close() ends (no orphaned sleep)
        f"#!{sys.executable}\nimport os, sys, time\ntime.sleep(5)\n"
        f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
    )
    slow.chmod(0o755)
    server = RendezvousServer(str(slow), timeout_s=30.0, start_timeout_s=0.5)
    with pytest.raises(LaunchError) as info:
        assert server.port
    message = str(info.value)
    assert "did not report its port within 0.5 s (--start-timeout)" in message, message
    assert "installed" not in message


@pytest.mark.timeout(60)
def test_a_store_that_cannot_start_quotes_its_error() -> None:
    server = RendezvousServer("/bin/false", timeout_s=30.0, start_timeout_s=30.0)
    with pytest.raises(
        LaunchError, match=r"did not start:\n\(no output\)\nHINT: .*ringtrain installed"
    ):
        assert server.port
