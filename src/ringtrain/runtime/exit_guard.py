"""Leaving the process without SIGABRT: no daemon thread may be inside a torch call then.

A daemon thread that returns from a torch call releasing the GIL (a Gloo wait, a store lookup)
while the interpreter finalizes dies in pybind11 with "terminate called without an active
exception" (SIGABRT), after the job's work is done, and the launcher reports a failed job.
So, at exit (atexit, before finalization):

- what daemon threads do in torch goes through :func:`native_call`: the sealed backend's
  failure notices, the wait watch's posts, each operation of a ringtrain process group's worker
  (sealed, TCP mesh), each message of a TCP mesh, each job of the engine's reducer and of the
  overlap updater. No new one starts, those under way are waited for. Freeing a tensor is such
  a call too (its destructor releases the GIL; so does ``Tensor.numpy()``): a daemon thread
  drops its last references inside the call, holds none while idle, and one that may not start
  a call any more hands what it holds to :func:`keep` instead of freeing it;
- threads that may still be inside such a call, the controllers of abandoned worlds and
  workers that did not stop at shutdown or were left with their world
  (:func:`leave_behind`), are joined;
- torch's own threads are not Python's to join: a Gloo worker drops its reference to a work
  after the waiter has seen the work finish, and this torch decrefs a tensor's PyObject (taking
  the GIL) whenever the tensor's count falls to one, so a worker that drops the last reference
  while the interpreter finalizes aborts too. That happens where groups are abandoned, not
  destroyed (a failing rank leaves its groups): the controllers' last rounds were seen (1 run
  in 3 of a 2-rank job whose ranks raise). The works the controllers issue are held
  (:func:`hold`), waited for at exit, and freed by the main thread.

Both waits together take at most :data:`EXIT_WAIT_S`; a thread still busy after that is named
on stderr, so an abort that follows says where it came from. ``tests/runtime/test_leaving.py``
shows the hazard on this torch and the guard.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TypeVar

from ringtrain.runtime.contracts import Work

# How long the exit waits, in all, for left-behind threads and native calls under way.
EXIT_WAIT_S = 3.0  # an abandoned controller's sliced wait ends within 1 s (runtime.abort)
_gate = threading.Condition()
_native_calls: dict[int, int] = {}  # thread ident -> native calls under way on it
_exiting = False
_left: list[threading.Thread] = []  # threads that may still be inside a torch call
_kept: list[object] = []  # what daemon threads could not free: the main thread frees it at exit
W = TypeVar("W", bound=Work)


# The controllers' last works are held (see the module docstring): the newest RECENT_WORKS,
# and older ones for as long as they are under way (an abandoned world's round may never end,
# and its worker's release must not become the last one when newer rounds follow).
RECENT_WORKS = 8
_held: list[Work] = []
_held_lock = threading.Lock()


def hold(work: W) -> W:
    """Keep ``work``, issued by a daemon thread on one of ringtrain's groups, so that its last
    reference is Python's (see the module docstring): among the newest :data:`RECENT_WORKS`,
    or for as long as it is under way."""
    with _held_lock:
        _held.append(work)
        if len(_held) > RECENT_WORKS:
            older = _held[:-RECENT_WORKS]
            _held[:-RECENT_WORKS] = [w for w in older if not w.is_completed()]
    return work


def release_finished() -> None:
    """The groups were destroyed (their Gloo workers joined): let go of the held works that
    finished. A held work keeps its group's connections open, which the next init in this
    process would find still there; one still under way (an abandoned world's) stays held."""
    with _held_lock:
        _held[:] = [w for w in _held if not w.is_completed()]


def leave_behind(thread: threading.Thread) -> None:
    """``thread`` (an abandoned world's controller, a worker that did not stop at shutdown)
    may still be inside a torch call: the process's exit waits for it (at most
    :data:`EXIT_WAIT_S` in all)."""
    with _gate:
        _left[:] = [t for t in _left if t.is_alive()]
        _left.append(thread)


@contextlib.contextmanager
def native_call() -> Iterator[bool]:
    """``with native_call() as ok: if ok: store.check(...)``: ``ok`` is False once the process
    is exiting, and the exit waits for calls under way (see the module docstring)."""
    me = threading.get_ident()
    with _gate:
        if _exiting:
            ok = False
        else:
            ok = True
            _native_calls[me] = _native_calls.get(me, 0) + 1
    try:
        yield ok
    finally:
        if ok:
            with _gate:
                _native_calls[me] -= 1
                if not _native_calls[me]:
                    del _native_calls[me]
                _gate.notify_all()


def keep(*objects: object) -> None:
    """Hold ``objects`` (tensors, or what holds them) for the rest of the process: a daemon
    thread whose :func:`native_call` was refused must not free them. The interpreter's exit
    frees them on the main thread, where that is safe."""
    with _gate:
        _kept.append(objects)


def settle(warn: bool = True) -> list[str]:
    """No new native calls from daemon threads, then wait for those under way and for
    left-behind threads, within :data:`EXIT_WAIT_S` (once: later calls return the first
    answer). Returns the threads still busy; ``warn``: name them on stderr (a process that
    then leaves with ``os._exit`` cannot abort there, and says nothing)."""
    global _settled
    with _gate:
        if _settled is not None:
            return _settled
    _settled = _settle(warn)
    return _settled


_settled: list[str] | None = None


def _settle(warn: bool) -> list[str]:
    global _exiting
    deadline = time.monotonic() + EXIT_WAIT_S
    with _gate:
        _exiting = True
        while _native_calls and _gate.wait(max(0.0, deadline - time.monotonic())):
            pass
        left = list(_left)
    me = threading.current_thread()
    for thread in left:
        if thread is not me:
            thread.join(max(0.0, deadline - time.monotonic()))
    with _held_lock:
        works = list(_held)
    while any(not w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.005)
    unfinished = sum(not w.is_completed() for w in works)
    keep(works)  # freed by the main thread at exit, where the GIL is its own
    with _gate:
        busy = set(_native_calls)
    names = {t.ident: t.name for t in threading.enumerate()}
    stuck = sorted({names.get(i, f"thread {i}") for i in busy})
    if unfinished:
        stuck.append(f"{unfinished} control round(s) on the wire")
    stuck += sorted({t.name for t in left if t is not me and t.is_alive()} - set(stuck))
    if stuck and warn:
        # What a rank's last words should say if the interpreter's exit now aborts it.
        sys.stderr.write(
            f"ringtrain: exiting after {EXIT_WAIT_S:g} s while {', '.join(stuck)} may still be "
            'inside a torch call; an abort now ("terminate called without an active '
            "exception\") comes from there, after this process's work was done.\n"
        )
        sys.stderr.flush()
    return stuck


def _settle_at_exit() -> None:
    """atexit: :func:`settle`, unless the process's last words already did."""
    settle()


atexit.register(_settle_at_exit)
