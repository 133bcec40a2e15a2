"""Horovod's ``horovod.ray.ray_logger``: values a worker sends to the driver's callbacks.

    from ringtrain.ray import ray_logger

    def train_fn():
        ...
        ray_logger.log({"epoch": epoch, "loss": loss})   # rank 0's reach the callbacks

    executor.run(train_fn, callbacks=[print])            # on the driver, in the order logged

Runs in the workers. While a ``run``/``execute`` with callbacks runs, the call carries the
driver's queue (:mod:`ringtrain.ray.callbacks`); ``log`` puts each dict there and returns once
it is queued, so nothing logged before the function returned is lost. As in Horovod, only rank 0
logs unless ``chief_only=False``, and a ``log`` without callbacks to take it warns once.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Protocol

from ringtrain import environ
from ringtrain.environ import Ringtrain


class ValueQueue(Protocol):
    """What a worker needs of the run's ``ray.util.queue.Queue``."""

    def put(self, item: object, block: bool = ..., timeout: float | None = ...) -> None: ...


_queue: ValueQueue | None = None  # the queue of the run in progress
_warned = False


def configure(queue: ValueQueue | None) -> None:
    """The queue of the call that starts (None: a call without callbacks)."""
    global _queue
    _queue = queue


def log(info_dict: Mapping[str, object], chief_only: bool = True) -> None:
    """Send ``info_dict`` to the driver's callbacks (``chief_only``: rank 0's only)."""
    global _warned
    if chief_only and _rank() != 0:
        return
    if _queue is None:
        if not _warned:
            _warned = True
            warnings.warn(
                "ray_logger.log was called, but this run has no callbacks to take it: pass "
                "callbacks=[...] to run()/execute()",
                stacklevel=2,
            )
        return
    _queue.put(info_dict)


def _rank() -> int:
    """This worker's rank now: ``hvd.rank()`` once ``hvd.init()`` ran (an elastic world may
    have renumbered it), else the rank it was started as."""
    from ringtrain.runtime import state

    if state.is_initialized():
        return state.current().rank
    return int(environ.current().get(Ringtrain.RANK, "0"))
