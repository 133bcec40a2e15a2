"""Where idle controllers doze: one key in the job's store that any rank of the set rings.

After a while with nothing to negotiate on any rank, every rank's controller of a set stops
polling and blocks on the same store key (the key names the episode, which every rank counts
alike: they decided to doze in one round). A submission, a shutdown or a lane claim that waits
rings it. The controller owns one :class:`Doorbell`; ``armed`` is read and cleared under the
controller's lock, so that exactly one thread rings a given episode.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A doze has no deadline of its own: a dead peer's controller fails the next round instead.
DOORBELL_WAIT = datetime.timedelta(days=7)


@dataclass
class Pace:
    """How busy the rounds are: with nothing in flight a controller naps between rounds (on
    ``wake``, which a submission sets), then, agreed with every rank, dozes until one rings."""

    wake: threading.Event = field(default_factory=threading.Event)
    idle_cycles: int = 0  # idle rounds in a row on this rank
    doze: bool = False  # every rank agreed, in the last round, to doze
    active: bool = False  # the last round carried requests


class Doorbell:
    """One process set's doorbell on this rank."""

    def __init__(self, store: Any, set_id: int, set_rank: int) -> None:
        self._store = store
        self._prefix = f"ringtrain/set{set_id}/doorbell"
        self._first = set_rank == 0
        self.naps = 0  # episodes so far, counted alike on every rank
        self.armed: str | None = None  # the key to set to wake the dozing controllers
        self._waiter: Any = None  # the controller's own store client, for dozing

    def disarm(self) -> str | None:
        """Take the key to ring, if the controllers doze (call under the controller's lock)."""
        key, self.armed = self.armed, None
        return key

    def ring(self, key: str | None) -> None:
        if key is not None:
            self._store.set(key, b"1")

    def next_episode(self) -> str:
        """The key of the next doze, which every rank enters alike."""
        self.naps += 1
        if self._first and self.naps > 2:
            # Everyone has left episode n-2: entering n-1 took a round they all joined.
            self._store.delete_key(f"{self._prefix}/{self.naps - 2}")
        return f"{self._prefix}/{self.naps}"

    def wait(self, key: str) -> None:
        """Block until ``key`` is rung. A store connection of the controller's own: a blocked
        wait holds its connection, and the submitting threads ring on the shared one."""
        if self._waiter is None:
            self._waiter = self._store.clone()
        self._waiter.wait([key], DOORBELL_WAIT)

    def settled(self, timeout: float, closed: Callable[[], bool]) -> bool:
        """Wait until the controllers doze, at most ``timeout`` seconds (see
        Controller.settle); a nap that began and ended between two looks counts too."""
        deadline = time.monotonic() + timeout
        naps = self.naps
        while self.armed is None and self.naps == naps and not closed():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True
