"""Leaving a replaced world (ringtrain.runtime.abort), and the process (runtime.exit_guard).

A daemon thread that is inside a torch call releasing the GIL (a store lookup, a Gloo wait) when
the interpreter finalizes kills the process with SIGABRT ("terminate called without an active
exception") after the job's work is done: that is how a secure elastic survivor died at exit
(stress runs of 2026-11-26). The exit now waits for such calls and refuses new ones; sliced waits
on ringtrain's own works (sealed, TCP mesh) wait again instead of failing after one slice.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ringtrain.errors import CollectiveAbortedError
from ringtrain.runtime import abort, exit_guard
from ringtrain.transport import tcp_backend
from ringtrain.transport.ring_group import RingWork
from ringtrain.transport.tcp_backend import TcpProcessGroup

# Daemon threads polling a store as fast as they can while the main thread ends.
_POLLER = textwrap.dedent(
    """
    import datetime, sys, threading, time
    import torch.distributed as dist
    from ringtrain.runtime import exit_guard

    guarded = sys.argv[1] == "guarded"
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))

    def poll():
        while True:
            if guarded:
                with exit_guard.native_call() as ok:
                    if ok:
                        store.check(["x"])
            else:
                store.check(["x"])

    def leftover():  # an abandoned world's controller: in torch calls for a while yet
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            store.check(["x"])

    for _ in range(3):
        threading.Thread(target=poll, daemon=True).start()
    if guarded:
        t = threading.Thread(target=leftover, daemon=True)
        t.start()
        exit_guard.leave_behind(t)
    time.sleep(0.2)
    print("done", flush=True)
    """
)


def _exit(mode: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-c", _POLLER, mode], capture_output=True, text=True, timeout=120
    )
    assert "done" in proc.stdout, proc.stderr
    return proc


@pytest.mark.timeout(300)
def test_the_process_exits_cleanly_with_daemon_threads_in_native_calls() -> None:
    # The hazard itself, on this torch: unguarded, the exit aborts.
    assert _exit("unguarded").returncode == -6
    for _ in range(3):
        guarded = _exit("guarded")
        assert guarded.returncode == 0, guarded.stderr
        # Threads that leave their native calls in time are not named (the exit's wait
        # message is only for one still busy: test_a_thread_still_busy_after_the_wait_is_named).
        assert "ringtrain: exiting" not in guarded.stderr, guarded.stderr


def _finish_later(work: RingWork, after_s: float) -> None:
    timer = threading.Timer(after_s, work._finish, args=(None,))
    timer.daemon = True
    timer.start()


def test_a_sliced_wait_on_a_ringtrain_work_waits_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abort, "announced", lambda: 0)
    monkeypatch.setattr(abort, "generation", 0)
    work = RingWork(lambda: None, None)
    _finish_later(work, abort.SLICE_S * 1.5)  # longer than one slice
    abort.wait_work(work)
    assert work.is_completed()


def test_a_sliced_wait_ends_when_the_world_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(abort, "announced", lambda: 1)  # the launcher announced world 1
    monkeypatch.setattr(abort, "generation", 0)
    work = RingWork(lambda: None, None)
    t0 = time.monotonic()
    with pytest.raises(CollectiveAbortedError, match="a peer failed"):
        abort.wait_work(work)
    assert time.monotonic() - t0 < abort.SLICE_S * 3


def test_a_rank_that_dies_of_a_signal_prints_where_every_thread_was() -> None:
    code = "import os, ringtrain; ringtrain.init(rank=0, size=1); os.abort()"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == -6
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr
    assert "ringtrain/collectives/controller.py" in proc.stderr, proc.stderr  # another thread


def _tcp_pair() -> list[TcpProcessGroup]:
    """Two members of one ``ringtrain_tcp`` group, made in this process (the constructor is
    collective, so each in its own thread)."""
    tcp_backend.configure("127.0.0.1")
    store = dist.HashStore()
    groups: list[TcpProcessGroup | None] = [None, None]

    def make(rank: int) -> None:
        groups[rank] = TcpProcessGroup(store, rank, 2, datetime.timedelta(seconds=60))

    makers = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in makers:
        t.start()
    for t in makers:
        t.join(60)
    tcp_backend.deconfigure()
    assert all(g is not None for g in groups)
    return [g for g in groups if g is not None]


@pytest.mark.timeout(120)
def test_leaving_a_group_ends_the_operation_waiting_on_a_peer_now() -> None:
    """An elastic survivor leaves its old world's groups (runtime.state.abandon): an operation
    waiting on a peer that will never take part ends now, not at the transport timeout, and
    the group's worker stops, so no daemon thread is inside torch when the process exits."""
    g0, g1 = _tcp_pair()
    try:
        stuck = g0.allreduce([torch.ones(1000)])  # rank 1 never joins it
        assert not stuck.is_completed() and not stuck._done.wait(0.3)
        t0 = time.monotonic()
        g0.leave()
        # Leaving never waits for peers (the transport timeout is 60 s; the bound is wide for
        # a loaded machine).
        assert time.monotonic() - t0 < 10.0
        assert stuck._done.wait(5.0)
        with pytest.raises(ConnectionError):
            stuck.wait()
        g0._thread.join(5.0)
        assert not g0._thread.is_alive()
        with pytest.raises(CollectiveAbortedError, match="world was replaced"):
            g0.allreduce([torch.ones(4)]).wait()
        # The peer's side sees the connection go, naming rank 0.
        with pytest.raises(ConnectionError, match="rank 0"):
            g1.allreduce([torch.ones(4)]).wait()
    finally:
        g0.leave()
        g1.shutdown()


def _held_tensors(thread: threading.Thread) -> list[str]:
    """The tensors (or views of their bytes) that ``thread``'s Python frames hold."""
    frame: Any = sys._current_frames().get(thread.ident or 0)
    held = []
    while frame is not None:
        for name, value in frame.f_locals.items():
            if isinstance(value, (torch.Tensor, memoryview)):
                held.append(f"{frame.f_code.co_name}: {name}")
        frame = frame.f_back
    return held


@pytest.mark.timeout(120)
def test_idle_group_threads_hold_no_tensor() -> None:
    """Freeing a tensor releases the GIL (and so does ``Tensor.numpy()``): a daemon thread that
    frees one while the interpreter finalizes aborts the process, so a group's worker and its
    TCP mesh threads free what an operation held before they go idle (inside a native call:
    runtime.exit_guard) and make no torch call of their own."""
    g0, g1 = _tcp_pair()
    try:
        for _ in range(3):
            works = [g.allreduce([torch.ones(10_000)]) for g in (g0, g1)]
            for w in works:
                w.wait()
        del works, w
        threads = [g._thread for g in (g0, g1)]
        for g in (g0, g1):
            threads += [t for peer in g._link.inner._peers.values() for t in peer.threads]
        deadline = time.monotonic() + 10
        while True:
            held = {t.name: _held_tensors(t) for t in threads}
            if not any(held.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # a thread may still be finishing its last message
        assert not any(held.values()), held
    finally:
        g0.shutdown()
        g1.shutdown()


def test_a_thread_still_busy_after_the_wait_is_named() -> None:
    """If a daemon thread is still inside a native call when the exit's wait runs out, the rank's
    stderr names it: an abort that may follow says where it came from."""
    code = textwrap.dedent(
        """
        import threading, time
        from ringtrain.runtime import exit_guard

        exit_guard.EXIT_WAIT_S = 0.5  # the same wait, shorter than its 3 s

        def busy():
            with exit_guard.native_call():
                time.sleep(30)  # longer than the exit waits

        threading.Thread(target=busy, name="busy-worker", daemon=True).start()
        time.sleep(0.2)
        """
    )
    assert exit_guard.EXIT_WAIT_S == 3.0  # what docs/diagnostics.md quotes
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 30
    assert "ringtrain: exiting after 0.5 s while busy-worker may still be inside a torch call" in (
        proc.stderr
    )


# Both ranks raise right after a collective, so each leaves while its controller's last rounds
# may still be in a Gloo worker's hands.
_RAISES = textwrap.dedent(
    """
    import torch, ringtrain.torch as hvd
    hvd.init()
    hvd.allreduce(torch.ones(4), name="a")
    raise ValueError("the data is bad")
    """
)


@pytest.mark.timeout(240)
def test_ranks_that_raise_exit_with_their_code_not_an_abort(tmp_path: Any) -> None:
    # Before the controllers' works were held (exit_guard.hold), 1 run in 3 had a rank abort:
    # a Gloo worker freed a finished round's tensors while the interpreter finalized.
    script = tmp_path / "raises.py"
    script.write_text(_RAISES)
    for _ in range(8):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ringtrain",
                "run",
                "-np",
                "2",
                "--",
                sys.executable,
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert proc.returncode != 0
        out = proc.stdout + proc.stderr
        assert "terminate called" not in out and "SIGABRT" not in out, out
        assert "exited with code 1" in out and "ValueError: the data is bad" in out, out


class _FakeWork:
    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        return True

    def is_completed(self) -> bool:
        return self.done


def test_a_round_still_under_way_stays_held_after_newer_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An abandoned world's round may never finish: its worker's late release must not become
    # the last one because newer rounds pushed it out of the held few.
    monkeypatch.setattr(exit_guard, "_held", [])
    stuck, finished = _FakeWork(), _FakeWork()
    finished.done = True
    exit_guard.hold(stuck)
    exit_guard.hold(finished)
    newer = [exit_guard.hold(_FakeWork()) for _ in range(3 * exit_guard.RECENT_WORKS)]
    held = exit_guard._held
    assert stuck in held and finished not in held
    assert held[-exit_guard.RECENT_WORKS :] == newer[-exit_guard.RECENT_WORKS :]
    for w in newer:
        w.done = True
    exit_guard.release_finished()  # the groups were destroyed: what finished is let go
    assert exit_guard._held == [stuck]
