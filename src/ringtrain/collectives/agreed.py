"""A fast-lane slot that moves its data only once every rank has claimed it for real.

From three ranks, an allreduce in place changes the whole tensor (a ring leaves partial sums in
it), so a lane slot that turns out lost (:mod:`~ringtrain.collectives.lane`: a peer claimed a
dummy) must give the tensor back from a copy taken at the claim. For a large tensor that copy
is most of what the lane costs over raw Gloo: at 4 ranks, 4 MiB, 1.30-1.41x Gloo's CPU per op
with it and 1.08-1.16x without (docs/benchmarks/log/2026-11-28-gloo-loop-spin.md).

So above :data:`AGREE_ABOVE_BYTES` a slot agrees before its data moves: each rank's claim is
one int32 (1: real, 0: a dummy) summed over the lane's group; only if every claim is real does
the data's allreduce start, in place, as a plain ``all_reduce`` would. A lost slot moves
nothing: the tensor is as submitted, and a dummy needs no data of its own. The price is one
small allreduce's latency before the data moves, which is less than the copy from 1 MiB on
(the same bound as :data:`~ringtrain.collectives.ordered.ALONE_ABOVE_BYTES`, above which the
data goes on Gloo's ring); below it the copy is the cheaper of the two.

Who starts the data: the thread that finishes the agreement, through its future's callback
(one of the group's own threads, so an async op nobody waits on yet starts at once), or
whichever thread asks first (:meth:`AgreedWork.is_completed`, :meth:`AgreedWork.wait`) where
the group's work has no callbacks.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ringtrain.collectives import ordered
from ringtrain.transport import group_ops

# Above this many bytes a slot agrees before its data moves (see the module's docstring).
AGREE_ABOVE_BYTES = 1 << 20


def agrees(nbytes: int, size: int) -> bool:
    """Whether a lane slot of ``nbytes`` on ``size`` ranks agrees before its data moves (two
    ranks need no copy: only a dummy's marked first value can change, see lane.py)."""
    return size > 2 and nbytes > AGREE_ABOVE_BYTES


class AgreedWork:
    """One agreed slot in flight, like a torch work: ``is_completed()`` and
    ``wait(timeout=None)`` (a timeout raises the transport's error, and the work can be waited
    on again). ``valid`` is None until the agreement is known, then whether the data moved."""

    def __init__(
        self, size: int, real: bool, start: Callable[[], Any], agree: group_ops.PreparedSum
    ) -> None:
        self._size = size
        self._start = start  # starts the data's allreduce; called once, if every claim is real
        self._flag = torch.tensor([1 if real else 0], dtype=torch.int32)
        self._lock = threading.Lock()
        self._data: Any = None
        self.valid: bool | None = None
        self._agreement = agree(self._flag)
        # Without callbacks (a work with no future), the first thread that asks starts the data.
        with contextlib.suppress(AttributeError, RuntimeError, NotImplementedError):
            self._agreement.get_future().then(self._on_agreed)

    def _on_agreed(self, fut: Any) -> None:
        # The work itself completes only after its future's callbacks return: waiting on it
        # here would wait for this very call. The future's value raises the agreement's error.
        with contextlib.suppress(Exception):  # its waiter raises it too
            self._advance(fut.value)

    def _advance(self, done: Callable[[], Any] | None = None) -> None:
        """Take the agreement (done: ``done()`` raises its error, or the work's ``wait()``)
        and start the data if every claim is real."""
        with self._lock:
            if self.valid is not None:
                return
            (done or self._agreement.wait)()
            valid = int(self._flag.item()) == self._size  # so this rank's claim is real too
            if valid:
                self._data = self._start()
            self.valid = valid

    def is_completed(self) -> bool:
        if self.valid is None:
            if not self._agreement.is_completed():
                return False
            self._advance()
        return self._data is None or bool(self._data.is_completed())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if self.valid is None:
            ordered.wait_until(self._agreement, deadline)
            self._advance()
        if self._data is not None:
            ordered.wait_until(self._data, deadline)
        return True
