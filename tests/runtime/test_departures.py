"""Departure posts: what a rank that leaves tells its peers, and how they read it (one process)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
import types

import psutil
import pytest
import torch.distributed as dist

from ringtrain.runtime import departures, processes
from ringtrain.runtime.departures import FAILED, FINISHED, STOPPED, Departure


def test_posts_are_read_failures_first_then_by_time() -> None:
    store = dist.HashStore()
    store.set(departures.PREFIX + "3", Departure(3, FINISHED, "", "b", 5.0).encode())
    store.set(departures.PREFIX + "2", Departure(2, FAILED, "OSError: disk", "a", 9.0).encode())
    store.set(departures.PREFIX + "1", Departure(1, FAILED, "ValueError: x", "a", 7.0).encode())
    got = departures.read(store, [0, 1, 2, 3])
    assert [d.rank for d in got] == [1, 2, 3]  # rank 0 posted nothing
    assert got[0].describe() == "rank 1 (host a) failed: ValueError: x"
    assert got[2].describe().startswith("rank 3 (host b) finished: its script ended")


def test_a_rank_posts_once_per_world_and_not_after_unbind(monkeypatch: pytest.MonkeyPatch) -> None:
    # bind() installs ringtrain's except hook once per process: keep this process's own.
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(departures, "_previous_hook", None)
    store = dist.HashStore()
    departures.bind(store, 4, "h")
    try:
        departures.post(FAILED, "RuntimeError: first")
        departures.post(FINISHED)  # the at-exit shutdown after a failure: the failure stands
        (only,) = departures.read(store, [4])
        assert (only.how, only.why, only.host) == (FAILED, "RuntimeError: first", "h")
    finally:
        departures.unbind()
    departures.post(FAILED, "after unbind")  # no store: nothing happens, nothing raises
    assert departures.read(store, [4])[0].why == "RuntimeError: first"


def test_an_exception_in_flight_is_posted_as_the_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """``shutdown()`` in a ``finally:`` or ``except:`` block runs before the except hook: the
    exception it runs under is the rank's failure, posted for its peers; an exit is not."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(departures, "_previous_hook", None)
    seen: list[str | None] = []
    for exc in (ValueError("the data\n is bad"), SystemExit(3), KeyboardInterrupt()):
        store = dist.HashStore()
        departures.bind(store, 1, "h")
        try:
            try:
                raise exc
            finally:
                seen.append(departures.raising())
        except (ValueError, SystemExit, KeyboardInterrupt):
            seen.append(departures.raising())  # handled, in an except block: the same
        finally:
            departures.unbind()
        posts = departures.read(store, [1])
        assert [(d.how, d.why) for d in posts] == ([(FAILED, seen[-1])] if seen[-1] else [])
    assert seen == ["ValueError: the data is bad"] * 2 + [None] * 4
    assert departures.raising() is None  # outside any block
    assert departures.failure() is None  # the process may go on: not kept as an uncaught one


def test_a_store_that_is_gone_reads_as_no_posts() -> None:
    class Gone:
        def clone(self) -> Gone:
            raise RuntimeError("Connection refused")

    assert departures.read(Gone(), [0, 1]) == []
    assert departures.read(None, [0, 1]) == []


def test_summary_is_one_short_line() -> None:
    assert departures.summary(ValueError("boom\n  at step 6")) == "ValueError: boom at step 6"
    assert departures.summary(KeyError()) == "KeyError"
    assert len(departures.summary(RuntimeError("x" * 1000))) == 300


def test_a_finished_post_takes_the_exit_code_the_launcher_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sys.exit(3) reaches no at-exit hook with its code: the rank posts that it finished, and
    ``ringtrain run`` records the code its agent saw (launch/supervisor.py); the peer reads
    both, through the job's prefixes, waiting a moment for the launcher's record."""
    from ringtrain.launch.failures import exited_key

    base = dist.HashStore()
    store = dist.PrefixStore("ringtrain/world", base)  # the ranks' store: prefixed
    for rank in (1, 2, 3):
        store.set(departures.PREFIX + str(rank), Departure(rank, FINISHED, "", "a", 1.0).encode())
    base.set(exited_key(1), "exited with code 3")  # the launcher writes under no prefix
    base.set(exited_key(2), "exited with code 0")
    monkeypatch.setattr(departures, "EXIT_WAIT_S", 0.2)
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: True)
    got = {d.rank: d for d in departures.read(store, [1, 2, 3])}
    assert got[1].how == FAILED and got[1].describe().startswith(
        "rank 1 (host a) failed: exited with code 3 without an exception (sys.exit"
    )
    assert got[2].how == FINISHED and got[3].how == FINISHED  # 3: no record within the wait


def test_an_end_at_exit_with_no_exit_code_known_is_not_called_a_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun or mpirun nobody records exit codes: a rank whose shutdown ran at exit
    may have ended with ``sys.exit(3)``. Its peer said "finished" and "HINT: no rank failed"
    (mpirun then named the peer's own exit code 1 as the first failure); it now says what it
    cannot know and where the code is. An explicit ``shutdown()``, or an exit the launcher
    recorded as code 0, is a finish."""
    from ringtrain.launch.failures import exited_key

    monkeypatch.setattr(departures, "EXIT_WAIT_S", 0.2)
    store = dist.HashStore()
    store.set(
        departures.PREFIX + "1", Departure(1, FINISHED, departures.AT_EXIT, "a", 1.0).encode()
    )
    store.set(departures.PREFIX + "2", Departure(2, FINISHED, "", "b", 2.0).encode())
    for records in (False, True):
        monkeypatch.setattr(departures, "_launcher_records_exits", lambda r=records: r)
        at_exit, called = departures.read(store, [1, 2])
        told = str(departures._named(0, "", [at_exit], "  (ended)"))
        assert at_exit.describe().startswith(
            "rank 1 (host a) left without an exception: its script ended or called sys.exit()"
        ), at_exit.describe()
        assert "no rank failed" not in told.split("HINT:")[1].split(";")[0], told
        assert "the exit code your launcher reports for rank 1" in told, told
        assert called.describe().startswith("rank 2 (host b) finished: its script ended")
    store.set(exited_key(1), "exited with code 0")
    at_exit, _ = departures.read(store, [1, 2])
    assert at_exit.describe().startswith("rank 1 (host a) finished: its script ended")
    assert "HINT: no rank failed" in str(departures._named(0, "", [at_exit], "  (ended)"))


def test_the_hint_follows_the_first_departure() -> None:
    failed = Departure(1, FAILED, "ValueError: x", "a", 7.0)
    finished = Departure(2, FINISHED, "", "b", 5.0)
    told = str(departures._named(0, "", [failed, finished], "  (ended)"))
    assert told.endswith(
        "HINT: the first failure above is the cause; fix it and start the job again."
    )
    told = str(departures._named(0, "", [finished], "  (ended)"))
    assert "HINT: no rank failed" in told and "join()" in told and "op=Min" in told


def test_an_interrupted_rank_did_not_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """An uncaught KeyboardInterrupt posts that the job was interrupted; ``ringtrain run``'s
    record of a rank that ended after it forwarded the signal says so too, naming it. A peer's
    error then gives no failure to fix; a signal the launcher did not send stays a failure,
    without the words about sys.exit that only an exit code calls for."""
    from ringtrain.launch.failures import exited_key, interrupted_words

    monkeypatch.setattr(sys, "excepthook", lambda *a: None)  # the hook's printing, quieted
    monkeypatch.setattr(departures, "_previous_hook", None)
    monkeypatch.setattr(departures, "EXIT_WAIT_S", 0.2)
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: True)
    store = dist.HashStore()
    departures.bind(store, 0, "a")
    try:
        sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
    finally:
        departures.unbind()
    (own,) = departures.read(store, [0])
    assert own.how == STOPPED and own.describe() == (
        "rank 0 (host a) left: the job was interrupted (KeyboardInterrupt)"
    )
    assert departures.failure() is None
    store.set(exited_key(0), interrupted_words("SIGINT"))
    store.set(departures.PREFIX + "1", Departure(1, FINISHED, "", "b", 2.0).encode())
    store.set(exited_key(1), "was killed by SIGKILL")
    stopped, killed = sorted(departures.read(store, [0, 1]), key=lambda d: d.rank)
    assert stopped.describe() == (
        "rank 0 (host a) left: the job was interrupted (SIGINT from the launcher)"
    )
    told = str(departures._named(2, "", [stopped], "  (ended)"))
    assert "HINT: no rank failed: the job was interrupted" in told and "fix it" not in told
    assert killed.how == FAILED and killed.why == "was killed by SIGKILL"


@pytest.mark.timeout(60)
def test_a_store_whose_server_died_is_given_up_within_the_read_timeout() -> None:
    # Rank 0 serves the store: where it was killed, a clone of the store retried its connect
    # for the job's whole timeout_s before the survivor could say anything.
    code = (
        "import sys, time, torch.distributed as d;"
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False);"
        "print(s.port, flush=True); time.sleep(60)"
    )
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline()) if server.stdout else 0
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=40),
        )  # fmt: skip
        store = dist.PrefixStore("ringtrain/gen1", client)
    finally:
        server.kill()
        server.wait()
    start = time.monotonic()
    assert departures.read(store, [0]) == []
    assert time.monotonic() - start < departures.READ_TIMEOUT_S + 8
    assert store.timeout == datetime.timedelta(seconds=40)  # the job's client keeps its own


def _present(store: dist.Store, rank: int, pid: int, started: float, machine: str = "") -> None:
    """What rank ``rank``'s bind() posts: which process it is."""
    record = {"machine": machine or processes.machine(), "pid": pid, "started": started}
    store.set(processes.PRESENT + str(rank), json.dumps(record))


def test_a_rank_says_which_process_it_is_when_it_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(departures, "_previous_hook", None)
    store = dist.HashStore()
    departures.bind(store, 3, "h")
    departures.unbind()
    said = json.loads(store.get(processes.PRESENT + "3"))
    assert said["pid"] == os.getpid() and said["machine"] == processes.machine() != ""
    assert said["started"] == psutil.Process().create_time()


def test_a_rank_that_cannot_say_which_process_it_is_still_binds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An enclave's /proc (Gramine's) may hold no boot id or pid namespace, or psutil may not
    read it: init() goes on, the rank posts nothing, and its peers say what they said before."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(departures, "_previous_hook", None)

    def unreadable(*_a: object) -> psutil.Process:
        raise psutil.AccessDenied()

    for patch in [("machine", lambda: ""), ("psutil", types.SimpleNamespace(Process=unreadable))]:
        with monkeypatch.context() as m:
            m.setattr(processes, *patch)
            store = dist.HashStore()
            departures.bind(store, 3, "h")
            departures.post(FAILED, "ValueError: x")  # bound all the same
            departures.unbind()
            assert not store.check([processes.PRESENT + "3"])
            assert [d.rank for d in departures.read(store, [3])] == [3]


@pytest.mark.timeout(60)
def test_where_no_launcher_records_ends_a_process_seen_ended_here_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun or mpirun a rank that left with os._exit or a signal posts nothing and
    nobody records its end: a peer on its machine sees its process ended (a zombie included)
    and names it, whether it posted a finish or not. A live one, one on another machine and
    a pid reused by another process are not named."""
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: False)
    monkeypatch.setattr(departures._here, "host", "h0")  # this peer's host: also the ranks'
    store = dist.HashStore()
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    try:
        for rank, p in enumerate(procs):
            _present(store, rank, p.pid, psutil.Process(p.pid).create_time())
        _present(store, 4, procs[0].pid, 1.0)  # a process with this pid started long ago
        _present(store, 5, 999_999_999, 1.0, machine="another-boot/1")
        store.set(
            departures.PREFIX + "2", Departure(2, FINISHED, departures.AT_EXIT, "a", 1.0).encode()
        )
        assert departures.gone(store, [0, 1, 2, 3, 5]) == {}
        procs[0].kill()
        procs[0].wait()  # reaped: no such process
        procs[1].kill()  # a zombie until its parent (here, this test) reaps it
        procs[2].kill()
        procs[2].wait()
        deadline = time.monotonic() + 10
        while psutil.Process(procs[1].pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got = departures.gone(store, [0, 1, 2, 3, 4, 5])
        assert sorted(got) == [0, 1, 2, 4]
        assert got[0] == (
            "rank 0 (host h0) ended without a word (os._exit, or killed by a signal) while this "
            "rank still waited for it",
            True,
        )
        assert got[2][0].startswith("rank 2 (host a) left without an exception: its script ended")
        t0 = time.monotonic()
        assert departures._vanished_here(store, [3], patient=False) == []  # alive: at once
        assert time.monotonic() - t0 < departures.VANISH_WAIT_S
        vanished = departures._vanished_here(store, [0, 3], patient=True)
        told = str(departures._named(9, "", vanished, "  (ended)"))
        assert "rank 9: a peer left the job: rank 0 (host h0) ended without a word" in told, told
        assert "HINT: the exit code your launcher reports for rank 0 tells" in told, told
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.timeout(60)
def test_a_rank_seen_ended_on_its_machine_is_named_on_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torchrun or mpirun across machines, only a peer on the vanished rank's machine can
    see its process end. It posts that for it, with the rank's host; a peer on another machine,
    whose wait broke too, waits for that post (up to TOLD_WAIT_S) and names the rank, and so
    does a checkpoint's look-out there (gone()). A post of the rank's own stays."""
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: False)
    monkeypatch.setattr(departures._here, "host", "h1")
    store = dist.HashStore()
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for rank, p in zip((2, 3), procs, strict=True):  # ranks 2 and 3 run on h1, here
            _present(store, rank, p.pid, psutil.Process(p.pid).create_time())
        me = psutil.Process()
        for rank in (0, 1):  # ranks 0 and 1 on h0, alive (this process, seen from h0)
            _present(store, rank, me.pid, me.create_time(), machine="h0-boot/1")
        store.set(departures.PREFIX + "2", Departure(2, FINISHED, "", "h1", 1.0).encode())
        procs[0].kill()
        procs[1].kill()
        for p in procs:
            p.wait()
        # Rank 1, on h0, sees no process of h1: no post for rank 3, so it waits in vain so far.
        with monkeypatch.context() as m:
            m.setattr(processes, "machine", lambda: "h0-boot/1")
            t0 = time.monotonic()
            assert departures._vanished_here(store, [0, 3], patient=False) == []
            assert time.monotonic() - t0 < departures.VANISH_WAIT_S
            assert departures._vanished_here(store, [0, 3], patient=True) == []
            waited = time.monotonic() - t0
            assert departures.TOLD_WAIT_S <= waited < departures.TOLD_WAIT_S + 2, waited
            assert departures.gone(store, [3]) == {}
        # A rank on h1 finds rank 3's process ended and posts that for it.
        [found] = departures._vanished_here(store, [3], patient=True)
        assert (found.rank, found.how, found.host) == (3, departures.VANISHED, "h1")
        assert Departure.decode(store.get(departures.PREFIX + "3")) == found
        departures._post_vanished(store, 2, {})  # a rank's own post stays
        assert Departure.decode(store.get(departures.PREFIX + "2")).how == FINISHED
        assert sorted(departures.gone(store, [2, 3])) == [2, 3]  # each process ended
        # Back on h0: the post names rank 3 and its host, at once.
        with monkeypatch.context() as m:
            m.setattr(processes, "machine", lambda: "h0-boot/1")
            m.setattr(departures._here, "host", "h0")
            t0 = time.monotonic()
            told = departures._vanished_here(store, [0, 3], patient=True)
            assert time.monotonic() - t0 < departures.TOLD_WAIT_S
            text = str(departures._named(1, "", told, "  (ended)"))
            assert "rank 1: a peer left the job: rank 3 (host h1) ended without a word" in text
            assert departures.gone(store, [0, 3]) == {
                3: (told[0].describe(), True),
            }
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.timeout(60)
def test_a_post_that_comes_while_a_peer_on_another_machine_waits_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer on the vanished rank's machine posts moments after this rank's wait broke:
    this rank's look ends when the post comes, not at TOLD_WAIT_S. While it waits it reads the
    posts again only when one came (one counter a look, not a key per rank: in a large job every
    peer looks at once)."""
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: False)
    store = dist.HashStore()
    asked: list[str] = []

    class Counted:  # this rank's client of the store, counting what it asks
        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

        def clone(self) -> Counted:  # the look's own client: this one, to count
            return self

        def check(self, keys: list[str]) -> bool:
            asked.extend(keys)
            return store.check(keys)

    ranks = list(range(1, 33))
    for r in ranks:  # 32 ranks elsewhere, on one machine, all alive, without doors
        _present(store, r, 999_999_999, 1.0, machine="h1-boot/1")
    t0 = time.monotonic()
    assert departures._vanished_here(Counted(), ranks, patient=True) == []  # type: ignore[arg-type]
    assert time.monotonic() - t0 >= departures.TOLD_WAIT_S
    reads = sum(k.startswith(departures.PREFIX) for k in asked)
    assert reads == len(ranks), reads  # read once, at the start: nothing was posted since
    # Now rank 3 is posted, by the peer on its machine, half a second into the look.
    seen_there = {3: processes.Process("h1-boot/1", "h1", 1, 1.0, None)}
    post = threading.Timer(0.5, lambda: departures._post_vanished(store, 3, seen_there))
    t0 = time.monotonic()
    post.start()
    try:
        [got] = departures._vanished_here(store, [3], patient=True)
        assert 0.4 < time.monotonic() - t0 < departures.TOLD_WAIT_S
        assert (got.rank, got.how, got.host) == (3, departures.VANISHED, "h1")
    finally:
        post.cancel()
        post.join()


def test_a_reader_that_asks_again_reads_each_process_post_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's look-out asks every second while a checkpoint's parts are written. Which process
    a rank is never changes in its world, so a reader keeping what it read reads each post once
    (not two requests per rank a second) and still sees a process end."""
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: False)
    store = dist.HashStore()
    reads: list[str] = []
    known: processes.Known = {}  # what the reader keeps

    class Counted:  # the reader's client, counting what it reads
        def check(self, keys: list[str]) -> bool:
            reads.extend(k for k in keys if k.startswith(processes.PRESENT))
            return store.check(keys)

        def get(self, key: str) -> bytes:
            reads.append(key)
            return bytes(store.get(key))

    proc = subprocess.Popen(["sleep", "60"])
    try:
        _present(store, 0, proc.pid, psutil.Process(proc.pid).create_time())
        _present(store, 1, 999_999_999, 1.0, machine="another-boot/1")
        client = Counted()
        for _ in range(3):
            assert departures.gone(client, [0, 1, 2], known) == {}  # type: ignore[arg-type]
        # Each post read once (a check, a get); rank 2's, not posted, asked each time.
        posts = [processes.PRESENT + str(r) for r in range(3)]
        assert sorted(reads) == sorted(posts[:2] * 2 + [posts[2]] * 3), reads
        proc.kill()
        proc.wait()
        assert sorted(departures.gone(client, [0, 1, 2], known)) == [0]  # type: ignore[arg-type]
    finally:
        proc.kill()
        proc.wait()
