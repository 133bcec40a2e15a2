"""Leaving a world that was replaced: long waits ask, between slices, whether to give up.

In an elastic job (:mod:`ringtrain.elastic`) a survivor can wait on another survivor that has
already left the failed world without closing its connections; such a wait would end only at the
transport timeout. ``superseded`` (set by ``@elastic.run``) says whether the launcher announced a
newer world; waits below check it every :data:`SLICE_S` and fail with the "peer failed" error.
Outside elastic jobs it is ``None`` and waits are plain, unsliced waits.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

from ringtrain.errors import CollectiveAbortedError

SLICE_S = 1.0
superseded: Callable[[], bool] | None = None


def check() -> None:
    """Raise :class:`CollectiveAbortedError` if the launcher replaced this world."""
    if superseded is not None and superseded():
        raise CollectiveAbortedError(
            "a peer failed: the launcher announced a new world while this rank waited"
        )


def wait_work(work: Any) -> None:
    """``work.wait()`` for a torch.distributed work, leaving early if the world was replaced.

    A work whose slice ran out can be waited on again (checked on torch 2.13's Gloo); past the
    job's transport timeout the last error is raised, as an unsliced wait would have.
    """
    if superseded is None:
        work.wait()
        return
    from ringtrain.runtime import state

    limit_s = state.current().config.timeout_s if state.is_initialized() else 300.0
    deadline = time.monotonic() + limit_s + SLICE_S
    while True:
        try:
            work.wait(timeout=datetime.timedelta(seconds=SLICE_S))
            return
        except RuntimeError as e:
            if "timed out" not in str(e).lower() or time.monotonic() > deadline:
                raise
        check()
