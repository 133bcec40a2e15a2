"""Leaving a world that was replaced: long waits ask, between slices, whether to give up.

In an elastic job (:mod:`ringtrain.elastic`) a survivor can wait on another survivor that has
already left the failed world without closing its connections; such a wait would end only at the
transport timeout. ``announced`` (set by ``@elastic.run``) gives the newest world the launcher
announced; a wait that began in an older world (``generation`` when it began) fails with the
"peer failed" error, checked every :data:`SLICE_S`. That frees the controller threads of
abandoned worlds too, so none is inside a Gloo call when the process exits. Outside elastic jobs
``announced`` is ``None`` and waits are plain, unsliced waits.

Leaving the process. A daemon thread that returns from a torch call releasing the GIL (a Gloo
wait, a store lookup) while the interpreter finalizes dies in pybind11 with "terminate called
without an active exception" (SIGABRT), after training finished. So threads that may still be in
such a call at exit, the controllers of abandoned worlds (:func:`leave_behind`), are joined at
exit, before finalization (their sliced waits end within :data:`SLICE_S` once replaced); and
calls made from daemon threads that poll (the sealed backend's failure notices) go through
:func:`native_call`, which refuses new calls from then on and waits for those under way.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ringtrain.errors import CollectiveAbortedError

SLICE_S = 1.0
announced: Callable[[], int] | None = None
generation = 0  # the world this process runs in now


def check(since: int | None = None) -> None:
    """Raise :class:`CollectiveAbortedError` if the launcher replaced world ``since`` (default:
    the current one)."""
    since = generation if since is None else since
    if announced is not None and announced() > since:
        raise CollectiveAbortedError(
            "a peer failed: the launcher announced a new world while this rank waited"
        )


def wait_work(work: Any, since: int | None = None) -> None:
    """``work.wait()`` for a torch.distributed work, leaving early if the world was replaced.

    A work whose slice ran out can be waited on again (checked on torch 2.13's Gloo); past the
    job's transport timeout the last error is raised, as an unsliced wait would have.
    """
    if announced is None:
        work.wait()
        return
    from ringtrain.runtime import state

    since = generation if since is None else since
    limit_s = state.current().config.timeout_s if state.is_initialized() else 300.0
    deadline = time.monotonic() + limit_s + SLICE_S
    while True:
        try:
            work.wait(timeout=datetime.timedelta(seconds=SLICE_S))
            return
        except RuntimeError as e:
            if "timed out" not in str(e).lower() or time.monotonic() > deadline:
                raise
        check(since)


# ---- leaving the process ------------------------------------------------------------------------

# How long the exit waits, in all, for left-behind threads and native calls under way.
EXIT_WAIT_S = SLICE_S + 2.0
_gate = threading.Condition()
_native_calls = 0  # native calls under way on daemon threads
_exiting = False
_left: list[threading.Thread] = []  # controller threads of abandoned worlds


def leave_behind(thread: threading.Thread) -> None:
    """``thread`` belongs to an abandoned world and may still be inside a torch call: the
    process's exit waits for it (at most :data:`EXIT_WAIT_S` in all)."""
    with _gate:
        _left[:] = [t for t in _left if t.is_alive()]
        _left.append(thread)


@contextlib.contextmanager
def native_call() -> Iterator[bool]:
    """``with native_call() as ok: if ok: store.check(...)``: ``ok`` is False once the process
    is exiting, and the exit waits for calls under way (see the module docstring)."""
    global _native_calls
    with _gate:
        if _exiting:
            ok = False
        else:
            ok = True
            _native_calls += 1
    try:
        yield ok
    finally:
        if ok:
            with _gate:
                _native_calls -= 1
                _gate.notify_all()


def _settle_at_exit() -> None:
    """atexit: no new native calls from daemon threads, then wait for those under way and for
    left-behind threads, within :data:`EXIT_WAIT_S`."""
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


atexit.register(_settle_at_exit)
