"""Handles of asynchronous collectives: ``poll`` never blocks, ``synchronize`` waits (both here,
re-exported by :mod:`ringtrain.collectives.ops`).

Every handle is also callable (``handle()`` waits and returns the result): Horovod's
``sparse_allreduce_async`` returns a plain function that its users call, so any handle can
stand where one of those is expected.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

from ringtrain.errors import CollectiveAbortedError, CollectiveArgumentError
from ringtrain.runtime import abort, departures

T = TypeVar("T", covariant=True)  # a handle only hands its result out


# Hands a waiter's Event to the thread that completes the handle. Most handles complete before
# anyone waits, or on the waiting thread itself (the fast lane's ops): they never make an Event,
# which costs more than the rest of a handle (issue 38, the caller's Python per op).
_WAKE = threading.Lock()


class Handle(Generic[T]):
    """The future result of one submitted collective (``Handle[torch.Tensor]`` for one tensor)."""

    __slots__ = ("_error", "_event", "_finish", "_finished", "_result", "name", "synchronized")

    def __init__(self, name: str, finish: Callable[[Any], Any] | None = None) -> None:
        self.name = name
        self._finished = False
        self._event: threading.Event | None = None  # made by the first waiter that must block
        self._result: Any = None
        self._error: BaseException | None = None
        self._finish = finish
        # Set by the first synchronize(), as Horovod's pops the handle from its map then: a
        # second synchronize() returns None and poll() raises (async_ops).
        self.synchronized = False

    def set_result(self, result: Any) -> None:
        self._result = result
        self._complete()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._complete()

    def _complete(self) -> None:
        with _WAKE:
            self._finished = True
            event = self._event
        if event is not None:
            event.set()

    def _wait_done(self, timeout: float | None) -> bool:
        """Whether the handle completed, waiting up to ``timeout`` (None: for ever)."""
        if self._finished:
            return True
        with _WAKE:
            if self._finished:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def done(self) -> bool:
        return self._finished

    def finished_within(self, timeout: float) -> bool:
        """Whether the handle completed (its result or error is in), waiting up to
        ``timeout`` seconds for it."""
        return self._wait_done(timeout)

    def wait(self, timeout: float | None = None) -> T:
        if not self._wait_done(timeout):
            raise CollectiveAbortedError(
                f"collective {self.name!r} did not complete within {timeout:g} s.\n"
                "HINT: another rank may not have submitted it; the stall inspector's report "
                "(--stall-warning-time, RINGTRAIN_STALL_WARNING_S) names the missing ranks."
            )
        if self._error is not None:
            # Peers told only that they left: their exit codes, read once here (not on the
            # control round's thread: it may wait for the launcher's record).
            self._error = departures.with_exit_codes(self._error)
            raise departures.again(self._error)
        result = self._result
        if self._finish is not None:
            result = self._finish(result)
            self._finish = None
            self._result = result
        return cast(T, result)  # finish() turned the raw result into what the call returns

    def __call__(self) -> T:
        """Wait and return the result, like :meth:`wait` (Horovod's sparse handles are called)."""
        return self.wait()

    def __repr__(self) -> str:
        return f"<Handle {self.name!r} {'done' if self.done() else 'pending'}>"


class CompositeHandle(Handle[T]):
    """One handle over several collectives: done when all are; its result is built from theirs
    (``build(*results)``) by the first ``wait``."""

    __slots__ = ("_build", "_parts")

    def __init__(self, name: str, parts: list[Handle[Any]], build: Callable[..., T]) -> None:
        super().__init__(name)
        self._parts = parts
        self._build = build

    def done(self) -> bool:
        return all(p.done() for p in self._parts)

    def wait(self, timeout: float | None = None) -> T:
        if not self._finished:
            self._result = self._build(*(p.wait(timeout) for p in self._parts))
            self._complete()
        return cast(T, self._result)


def _check_handle(fn: str, handle: Any) -> None:
    if not isinstance(handle, Handle):
        raise CollectiveArgumentError(f"{fn} expects a handle from an *_async call, got {handle!r}")


def synchronize(handle: Handle[T]) -> T:
    """Wait for an asynchronous collective and return its result (raises its error). As in
    Horovod, the first call releases the handle, with its result or its error: a second
    ``synchronize`` of it returns None (``handle()`` still returns the result)."""
    _check_handle("synchronize", handle)
    if handle.synchronized:
        return cast(T, None)  # Horovod's: `if handle not in _handle_map: return`
    try:
        result = _wait(handle)
    except Exception:
        handle.synchronized = True  # Horovod pops a failed handle too
        raise
    handle.synchronized = True
    return result


def _wait(handle: Handle[T]) -> T:
    if abort.announced is None:
        return handle.wait()
    since = abort.generation
    while True:  # elastic: a controller stuck on an abandoned world would never answer
        try:
            return handle.wait(abort.SLICE_S)
        except CollectiveAbortedError:
            if handle.done():
                raise  # the op's own error, not the slice running out
        abort.check(since)


def poll(handle: Handle[Any]) -> bool:
    """True once the collective finished (``synchronize`` then returns at once); never blocks.
    A handle already synchronized raises ``ValueError``, as Horovod's, which no longer knows it."""
    _check_handle("poll", handle)
    if handle.synchronized:
        raise CollectiveArgumentError(
            f"poll: the handle of {handle.name!r} was synchronized already; Horovod releases a "
            "handle there.\nHINT: poll a handle before synchronize(), or keep the result that "
            "synchronize() returned."
        )
    return handle.done()
