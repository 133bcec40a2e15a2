"""Leaving a world that was replaced: long waits ask, between slices, whether to give up.

In an elastic job (:mod:`ringtrain.elastic`) a survivor can wait on another survivor that has
already left the failed world without closing its connections; such a wait would end only at the
transport timeout. ``announced`` (set by ``@elastic.run``) gives the newest world the launcher
announced; a wait that began in an older world (``generation`` when it began, or the world its
thread works for: a controller thread's, see :func:`bind_world`) fails with the "peer failed"
error, checked every :data:`SLICE_S`. That frees the controller threads of abandoned worlds
too, so none is inside a Gloo call when the process exits. Outside elastic jobs ``announced`` is
``None`` and waits are plain, unsliced waits.

Abandoned controllers may still be inside such a wait when the process exits:
:mod:`ringtrain.runtime.exit_guard` makes the exit wait for them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

from ringtrain.errors import CollectiveAbortedError
from ringtrain.runtime import departures
from ringtrain.runtime.contracts import Work

SLICE_S = 1.0
T = TypeVar("T")
announced: Callable[[], int] | None = None
generation = 0  # the world this process runs in now
_thread = threading.local()  # .world: the world a thread works for (see bind_world)
# Threads inside stopping() with a check, counted so that sliced() costs two reads where none is
# (every blocking collective asks).
_stoppers = 0
_stoppers_lock = threading.Lock()


def bind_world(world: int) -> None:
    """The calling thread works for world ``world``: its waits and checks without a ``since``
    count from it, not from :data:`generation`. A controller thread binds its own world, so a
    wait it starts after the process entered a newer world still ends (its world was replaced)."""
    _thread.world = world


def _world() -> int:
    world: int = getattr(_thread, "world", generation)
    return world


def replaced(since: int | None = None) -> bool:
    """Whether the launcher replaced world ``since`` (default: the calling thread's, see
    :func:`bind_world`; else the current one)."""
    since = _world() if since is None else since
    return announced is not None and announced() > since


def check(since: int | None = None) -> None:
    """Raise :class:`CollectiveAbortedError` if the launcher replaced world ``since`` (default:
    the calling thread's, see :func:`bind_world`; else the current one)."""
    if replaced(since):
        raise CollectiveAbortedError(
            "a peer failed: the launcher announced a new world while this rank waited"
        )


@contextlib.contextmanager
def stopping(stop: Callable[[], None] | None) -> Iterator[None]:
    """While inside, this thread's waits (:func:`wait_work`, :func:`wait_future`) are sliced and
    call ``stop()`` between slices, which raises to end the wait (``step()``'s wait at the stall
    shutdown time: :class:`ringtrain.diagnostics.engine_wait.WaitWatch`). None: no change."""
    global _stoppers
    kept = getattr(_thread, "stop", None)
    _thread.stop = stop if stop is not None else kept
    with _stoppers_lock:
        _stoppers += stop is not None
    try:
        yield
    finally:
        _thread.stop = kept
        with _stoppers_lock:
            _stoppers -= stop is not None


def sliced() -> bool:
    """Whether this thread's waits are sliced: in an elastic job (its launcher can announce a
    new world) or inside :func:`stopping` with a check."""
    return announced is not None or (_stoppers > 0 and getattr(_thread, "stop", None) is not None)


def wait_future(fut: concurrent.futures.Future[T]) -> T:
    """``fut.result()``, sliced where this thread has a :func:`stopping` check."""
    stop: Callable[[], None] | None = getattr(_thread, "stop", None)
    if stop is None:
        return fut.result()
    while True:
        try:
            return fut.result(timeout=SLICE_S)
        except concurrent.futures.TimeoutError:
            if fut.done():
                raise  # the operation's own timeout, not the slice's
        stop()  # outside the except: its error is no consequence of the slice's timeout


def wait_work(work: Work, since: int | None = None) -> None:
    """``work.wait()`` for a torch.distributed work, leaving early if the world was replaced
    (or this thread's :func:`stopping` check raises).

    A work whose slice ran out can be waited on again (checked on torch 2.13's Gloo); past the
    job's transport timeout the last error is raised, as an unsliced wait would have.
    """
    stop: Callable[[], None] | None = getattr(_thread, "stop", None)
    if announced is None and stop is None:
        try:
            work.wait()
        except RuntimeError as e:  # a peer left: name it where it said why (runtime.departures)
            raise_named(e)
        return
    from ringtrain.runtime import state

    since = _world() if since is None else since
    limit_s = state.current().config.timeout_s if state.is_initialized() else 300.0
    deadline = time.monotonic() + limit_s + SLICE_S
    while True:
        try:
            work.wait(timeout=datetime.timedelta(seconds=SLICE_S))
            return
        except RuntimeError as e:
            if "timed out" not in str(e).lower() or time.monotonic() > deadline:
                raise_named(e)
        check(since)
        if stop is not None:
            stop()


def raise_named(e: RuntimeError) -> NoReturn:
    """Raise ``e``, or the :class:`~ringtrain.errors.PeerFailedError` that names the peer whose
    departure broke it (see :mod:`ringtrain.runtime.departures`)."""
    named = departures.peer_error(e)
    if named is e:
        raise e
    raise named from e
