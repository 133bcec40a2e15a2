"""Waits of the engine's worker threads, watched as ``step()``'s own (diagnostics.engine_wait).

Local updates' outer exchange runs on its group's worker; the optimizer waits for its results.
Such a wait is watched as a synchronous ``step()``'s: past the stall warning time the ranks
missing are named, past the stall shutdown time it ends in a StallError naming them.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, TypeVar

from ringtrain import transport
from ringtrain.diagnostics import engine_wait
from ringtrain.runtime import abort

T = TypeVar("T")


def watched_result(
    watch: engine_wait.WaitWatch | None, step: int, fut: concurrent.futures.Future[T], what: str
) -> T:
    """``fut.result()`` (collectives a worker thread runs for this one) watched as ``step()``'s
    own wait, as wait ``step`` for ``what`` (see :func:`explain`): past the stall warning
    time the ranks missing are named, past the stall shutdown time the wait ends in a
    StallError naming them. ``watch`` None: a plain wait."""
    if watch is None:
        return fut.result()
    watch.begin(step, what)
    try:
        with abort.stopping(watch.check if watch.shutdown_s > 0 else None):
            return abort.wait_future(fut)
    except RuntimeError as e:
        named = watch.failed(e)
        if named is e:
            raise
        raise named from e
    finally:
        watch.end()


class WatchedHold(transport.Hold):
    """The outer exchange's hold on its group's worker (:class:`ringtrain.transport.Hold`),
    whose results are waited for as ``step()``'s gradients are (``engine_wait``)."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.watch: engine_wait.WaitWatch | None = None
        self.waits = 0  # watched waits so far: the same count on every rank

    def result(self, fut: concurrent.futures.Future[T], every: int) -> T:
        self.waits += 1
        what = f"the outer exchange of local updates (sync_every={every})"
        return watched_result(self.watch, self.waits, fut, what)
