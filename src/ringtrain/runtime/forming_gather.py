"""The first exchange of an elastic world: a peer lost while it forms must not hold it up.

A world's first collective (``state.start``'s topology gather) is where its pairs connect. A
peer lost before it posted its address is caught by :mod:`.watched_store`; one lost after it
did leaves its address to read, so the connect goes to a dead port: Gloo failed it after a few
refused retries or, with other timing, sat in the gather (seen until the test stopped it). Here
the gather runs async and its waits are sliced: between slices, and after a peer's error, it
asks whether the launcher announced a newer world (it sees a lost rank on its own host at
once, a lost host in about 20 s), and then raises :class:`WorldSuperseded`, which sends
``init()`` on to the newest world, as for a peer lost earlier.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

from ringtrain.runtime import object_gather
from ringtrain.runtime.arrivals import WorldSuperseded
from ringtrain.runtime.contracts import Group, Work

SLICE_S = 0.5  # the longest wait between two looks at the launcher's newest world
ANNOUNCE_GRACE_S = 30.0  # after a peer's error: time for the launcher to announce its loss


def all_gather_object(
    obj: object,
    size: int,
    group: Group,
    superseded: Callable[[], bool],
    timeout_s: float,
) -> list[object]:
    """Every rank's ``obj`` in rank order, as ``dist.all_gather_object``, over ``group``
    (``size`` ranks); raises :class:`WorldSuperseded` once a newer world is announced."""
    return object_gather.all_gather_object(
        obj, size, group, lambda work: _wait(work, superseded, timeout_s)
    )


def _wait(work: Work, superseded: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    failure: RuntimeError | None = None
    while True:
        if failure is None:
            try:
                work.wait(timeout=datetime.timedelta(seconds=SLICE_S))
                return
            except RuntimeError as e:
                # A slice that ran out says "timed out"; so does Gloo's refused connect, which
                # a second wait would raise again: either way, ask below.
                if "timed out" not in str(e).lower() or "connect" in str(e).lower():
                    failure = e
                    deadline = min(deadline, time.monotonic() + ANNOUNCE_GRACE_S)
                elif time.monotonic() > deadline:
                    raise
        else:
            time.sleep(SLICE_S)
        if superseded():
            raise WorldSuperseded(
                "a newer world was announced while this world's ranks first exchanged"
            ) from failure
        if failure is not None and time.monotonic() > deadline:
            raise failure
