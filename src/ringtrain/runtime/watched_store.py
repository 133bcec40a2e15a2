"""The store an elastic world's process groups are made with: its waits end when the world is
replaced.

Gloo reads each peer's address from the store when a pair connects: in the group's constructor,
or (lazy init, ringtrain's default) at the pair's first exchange. A peer that died before it
posted its address leaves that read waiting for the whole ``timeout_s``, and, as a TCPStore
client serves one request at a time, every other use of the same client waits behind it. Here a
blocking ``get``/``wait`` polls with ``check`` in short slices instead and, between slices, asks
whether the launcher announced a newer world; then it raises :class:`WorldSuperseded`, which
reaches the caller of the collective or of ``new_group`` as it is (torch carries the Python
exception through Gloo's threads). A peer lost after it posted its address is left to the
world's first exchange (:mod:`.forming_gather`).

Only pair connects read the store: a group's collectives never call it once their pairs are
connected. Gloo calls it from C++ (its own threads, too) and holds only the C++ object: the
Python object that answers is kept here for the process's lifetime, as abandoned groups are.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

from ringtrain.runtime.arrivals import WorldSuperseded

SLICE_S = 0.05  # the longest pause between two looks at a missing key
ASK_EVERY_S = 0.5  # how often a wait asks the launcher's store whether the world was replaced
_kept: list[WatchedStore] = []


class WatchedStore(dist.Store):
    """``inner``, whose blocking reads give up once ``superseded()`` (see the module)."""

    def __init__(self, inner: dist.Store, superseded: Callable[[], bool], timeout_s: float) -> None:
        super().__init__()
        self._inner = inner
        self._superseded = superseded
        self._timeout = datetime.timedelta(seconds=timeout_s)
        _kept.append(self)

    def set(self, key: str, value: str) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._await([key], self._timeout)
        return self._inner.get(key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._await(keys, self._timeout if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def has_extended_api(self) -> bool:
        return False  # Gloo then reads key by key, through get

    def _await(self, keys: list[str], timeout: datetime.timedelta) -> None:
        start = time.monotonic()
        pause, ask_at = 0.001, start + ASK_EVERY_S
        while not self._inner.check(keys):
            now = time.monotonic()
            if now >= ask_at:
                ask_at = now + ASK_EVERY_S
                if self._superseded():
                    raise WorldSuperseded(f"a newer world was announced while waiting for {keys}")
            if now - start > timeout.total_seconds():
                raise dist.DistStoreError(
                    f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: {keys}"
                )
            time.sleep(pause)
            pause = min(pause * 2, SLICE_S)
