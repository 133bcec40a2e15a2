"""Horovod's ``run(..., callbacks=[...])`` on the driver: every value the workers log
(:mod:`ringtrain.ray.ray_logger`) is handed to each callback, in the order logged.

A Ray queue (an actor of no CPU) carries the values; a driver thread takes them while the run
waits and, once the run's results are in, takes what is left before it stops, so every value
logged before a worker's function returned reaches the callbacks. A callback that raises is
reported with its traceback and called no more; the run goes on and returns its results. One
still busy :data:`DRAIN_S` after the results are in is left behind, said in a warning, so that a
callback that blocks cannot hold ``run`` forever.
Horovod documents callbacks for ``RayExecutor`` too but takes them only in its elastic
executor; ringtrain takes them in both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from ringtrain.errors import ConfigError
from ringtrain.ray.ray_logger import ValueQueue


class RunQueue(ValueQueue, Protocol):
    """What the driver needs of the run's ``ray.util.queue.Queue`` (the workers, its put)."""

    def get(self, block: bool = ..., timeout: float | None = ...) -> object: ...
    def shutdown(self, force: bool = ..., grace_period_s: int = ...) -> None: ...


log = logging.getLogger("ringtrain")
R = TypeVar("R")
Callback = Callable[[object], object]  # takes one logged value
POLL_S = 0.1  # how long the driver thread waits for a value before it looks whether to stop
DRAIN_S = 60.0  # how long the run waits for the callbacks once its results are in (Horovod's)


def checked(callbacks: Sequence[object] | None) -> list[Callback]:
    """The callbacks, each a function or an object with ``__call__`` (else a ``ConfigError``
    naming it, before any worker runs)."""
    out: list[Callback] = []
    for i, c in enumerate(callbacks or []):
        if not callable(c):
            raise ConfigError(
                f"callbacks[{i}] is not callable: {c!r} ({type(c).__name__}).\nHINT: each "
                "callback is a function, or an object with __call__, that takes one logged value."
            )
        out.append(c)
    return out


class Delivery:
    """While inside: the values logged into :attr:`queue` go to the callbacks (``with``)."""

    def __init__(self, callbacks: list[Callback], queue: RunQueue | None = None) -> None:
        """``queue``: a Ray queue actor is started unless one is given (tests)."""
        if queue is None:
            from ray.util.queue import Queue

            queue = Queue(actor_options={"num_cpus": 0})
        self.callbacks = callbacks
        self.queue = queue
        self._failed: set[int] = set()
        self._stop = threading.Event()
        # A daemon: one left behind in a blocked callback must not hold the driver's exit.
        self._thread = threading.Thread(
            target=self._take, name="ringtrain-ray-callbacks", daemon=True
        )

    def __enter__(self) -> Delivery:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(DRAIN_S)
        if self._thread.is_alive():
            log.warning(
                "ringtrain: a callback was still busy %.0f s after the run's results were in; "
                "the run returns without it, and values still queued are not delivered",
                DRAIN_S,
            )
        self.queue.shutdown()

    def _take(self) -> None:
        from ray.util.queue import Empty

        while True:
            try:
                value = self.queue.get(timeout=POLL_S)
            except Empty:
                if self._stop.is_set():
                    return  # stopped, and nothing is left
                continue
            except Exception as e:  # the queue's actor is gone (the run ended without us)
                if not self._stop.is_set():
                    log.warning("ringtrain: the callbacks' queue failed: %s", e)
                return
            self._deliver(value)

    def _deliver(self, value: object) -> None:
        for i, c in enumerate(self.callbacks):
            if i in self._failed:
                continue
            try:
                c(value)
            except Exception:
                self._failed.add(i)
                log.exception(
                    "ringtrain: callbacks[%d] (%r) raised on a logged value; it is called no "
                    "more (the run goes on)",
                    i,
                    c,
                )


@dataclass(frozen=True)
class Logged(Generic[R]):
    """An ``execute`` function that runs ``fn`` with the run's queue configured in the worker
    (None: a run without callbacks, so that a queue of an earlier run is never used)."""

    fn: Callable[[object], R]
    queue: ValueQueue | None = None

    def __call__(self, executable: object) -> R:
        from ringtrain.ray import ray_logger

        ray_logger.configure(self.queue)
        try:
            return self.fn(executable)
        finally:
            ray_logger.configure(None)
