"""Which process each rank is: a door that a live rank's kernel answers and a dead rank's
refuses, knocked on by peers on other machines (ringtrain.runtime.processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest
import torch.distributed as dist

from ringtrain.runtime import departures, processes
from ringtrain.security.notes import PLAIN

pytestmark = pytest.mark.timeout(60)

# A rank's process as init() leaves it: posted, with its door open; then busy or asleep.
RANK = """
import sys, time
import torch.distributed as dist
from ringtrain.runtime import processes
from ringtrain.security.notes import PLAIN
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
processes.say_present(store, int(sys.argv[2]), "h1", PLAIN)
print("posted", flush=True)
time.sleep(60)
"""


def _rank(port: int, rank: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK, str(port), str(rank)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "posted"
    return proc


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_live_ranks_door_answers_and_a_dead_ones_refuses(store: dist.TCPStore) -> None:
    """Whatever the process does (here: asleep), its kernel answers; once it is killed, its
    port refuses. A SIGSTOPped process still answers: stuck is not gone."""
    procs = [_rank(store.port, r) for r in (1, 2)]
    try:
        known: processes.Known = {}
        processes._read(store, [1, 2], PLAIN, known)
        doors = {r: known[r].door for r in (1, 2)}
        assert all(d is not None and d[0] == "127.0.0.1" for d in doors.values()), doors
        assert (known[1].host, known[1].pid) == ("h1", procs[0].pid)
        assert processes.refused(doors) == []  # type: ignore[arg-type]
        os.kill(procs[1].pid, signal.SIGSTOP)
        procs[0].kill()
        procs[0].wait()
        t0 = time.monotonic()
        assert processes.refused(doors) == [1]  # type: ignore[arg-type]
        assert time.monotonic() - t0 < processes.KNOCK_TIMEOUT_S  # a refusal is one round trip
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_door_that_does_not_answer_names_no_one() -> None:
    """A knock that gets no answer (a machine or a network down; here, a listener whose backlog
    is full, so the kernel drops the knock) says nothing: only a refusal names a rank."""
    import socket

    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    where = full.getsockname()
    queued = []
    try:
        for _ in range(4):  # fill the accept queue: later knocks are dropped, not refused
            s = socket.socket()
            s.settimeout(0.2)
            try:
                s.connect(where)
            except OSError:
                s.close()
                break
            queued.append(s)
        t0 = time.monotonic()
        assert processes.refused({7: where}, timeout_s=0.3) == []
        assert time.monotonic() - t0 >= 0.25  # it waited for an answer, and got none
    finally:
        for s in queued:
            s.close()
        full.close()


def test_a_door_that_cannot_be_opened_leaves_no_socket(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An address this host does not have (a stale interface setting): init() goes on, the post
    says there is no door, and the socket made for it is closed, not dropped unclosed."""
    monkeypatch.setattr(processes.network, "local_address", lambda *_: "198.18.255.254")
    made: list[socket.socket] = []

    class Recorded(socket.socket):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    # Each socket made is kept here, so it is closed only if the code closed it. (Counting
    # ResourceWarnings at a gc.collect() also counted what earlier tests in this worker had
    # dropped: one loaded run found four.)
    monkeypatch.setattr(processes.socket, "socket", Recorded)
    processes.say_present(store, 6, "h0", PLAIN)
    monkeypatch.undo()
    assert made and all(s.fileno() == -1 for s in made), made
    known: processes.Known = {}
    processes._read(store, [6], PLAIN, known)
    assert known[6].door is None and known[6].pid == os.getpid()


def test_a_forked_child_does_not_hold_the_door_open(store: dist.TCPStore) -> None:
    """A DataLoader worker or a writer forked from the rank outlives it for a moment, or for
    good: the door closes in the child, so the rank's end is still seen."""
    processes.say_present(store, 5, "h0", PLAIN)
    known: processes.Known = {}
    processes._read(store, [5], PLAIN, known)
    door = known[5].door
    assert door is not None
    ready_r, ready_w = os.pipe()
    child = os.fork()
    if child == 0:  # the child: sleep, holding whatever it inherited
        os.write(ready_w, b"1")  # its fork hooks have run
        time.sleep(30)
        os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1"
        assert processes.refused({5: door}) == []
        processes._close_door()  # what this rank's end does to its sockets
        assert processes.refused({5: door}) == [5]
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready_r)


def test_a_rank_that_exits_closes_its_door_without_a_warning(store: dist.TCPStore) -> None:
    # Before, the door was left to the interpreter's last collection: "ResourceWarning:
    # unclosed <socket.socket ...>" at every rank's exit where warnings show (python -X dev).
    # A rank's imports (ringtrain.torch: torch whole), without which the interpreter's last
    # collection happens to come after its warnings are gone.
    exits = RANK.replace("time.sleep(60)", "").replace(
        "import sys,", "import ringtrain.torch, sys,"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "always::ResourceWarning", "-c", exits, str(store.port), "3"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "posted", proc.stderr
    assert "ResourceWarning" not in proc.stderr, proc.stderr


def test_a_door_on_loopback_is_not_knocked_on() -> None:
    """A rank whose door is on 127.0.0.1 (its store's host was this machine's loopback):
    knocked on from another machine, that port would be the knocker's own and refuse."""
    known = {
        1: processes.Process("m1", "h1", 1, 1.0, ("127.0.0.1", 1)),
        2: processes.Process("m2", "h2", 1, 1.0, ("127.0.1.1", 1)),
    }
    assert processes.knock([1, 2], known) == []


def test_each_peer_knocks_on_a_window_of_doors_and_together_on_all() -> None:
    """Up to KNOCK_MAX ranks elsewhere, a peer knocks on every door. Beyond, each peer knocks on
    KNOCK_MAX of them, from its own rank times KNOCK_MAX on: at 1,024 ranks the peers together
    knock on every door, each door about KNOCK_MAX times (not N squared knocks in all)."""
    mine = processes.machine()
    known = {
        1: processes.Process("m1", "h1", 1, 1.0, None),
        2: processes.Process(mine, "h0", os.getpid(), psutil.Process().create_time(), None),
    }
    assert processes.elsewhere([1, 2, 3], known) == [1]  # 3 did not post
    few = list(range(10))
    assert processes.window(few, 7 * processes.KNOCK_MAX) == few
    ranks = list(range(1, 1024))  # as rank 0 sees the others
    knocks = [0] * 1024
    for me in range(1024):
        others = [r for r in range(1024) if r != me]
        seen = processes.window(others, me * processes.KNOCK_MAX)
        assert len(seen) == processes.KNOCK_MAX and me not in seen
        for r in seen:
            knocks[r] += 1
    assert min(knocks) >= 1 and max(knocks) <= 2 * processes.KNOCK_MAX, (min(knocks), max(knocks))
    assert processes.window(ranks, 1023 * processes.KNOCK_MAX)[0] == ranks[(1023 * 64) % 1023]


def test_a_rank_alone_on_another_machine_is_named_when_its_door_refuses(
    store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun or mpirun with one rank per machine, no peer sees the rank's process: the
    peer whose wait broke knocks on its door, names it at once with its host (no wait for a
    post that no one would make), and posts that for the others."""
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: False)
    proc = _rank(store.port, 1)
    monkeypatch.setattr(processes, "machine", lambda: "h0-boot/1")  # this peer: elsewhere
    # Its door is on loopback, as the store is: knocked on all the same, this machine playing
    # both (a loopback door is not knocked on in a job: test_a_door_on_loopback_...).
    monkeypatch.setattr(processes, "_knockable", lambda address: True)
    try:
        assert departures._vanished_here(store, [1], patient=False) == []  # alive
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        [gone] = departures._vanished_here(store, [1], patient=True)
        assert time.monotonic() - t0 < departures.VANISH_WAIT_S
        assert (gone.rank, gone.how, gone.host) == (1, departures.VANISHED, "h1")
        assert departures.read(store, [1]) == [gone]  # posted for the others
    finally:
        proc.kill()
        proc.wait()
