"""What the layers above pass around as a process group, a store and work in flight.

They are torch's objects (``ProcessGroup``, ``Store``, ``Work``), made here in the runtime; the
layers above use a few of their methods, which these protocols name, so that a fake in a test
or another backend's object serves as well and mypy checks each use. torch's classes satisfy
them as its stubs declare them (``tests/typing/seams.py`` holds that), so methods torch has but
its stubs lack (``Store.clone``, ``Store.append``) are left out: a caller that needs one asks
with ``hasattr`` first.

A group is mostly handed on to ``torch.distributed``'s collectives (``dist.all_reduce(t,
group=g)``), whose ``group`` parameter torch leaves untyped: what ringtrain calls on it itself
is its rank and size. Where a torch function does type it (``destroy_process_group``,
``broadcast``), the runtime, which made the group, hands it out as torch's class
(:meth:`ringtrain.runtime.communicator.Communicator.group_for`), which satisfies :class:`Group`.
"""

from __future__ import annotations

import datetime
from typing import Protocol


class Group(Protocol):
    """A process group: torch's ``ProcessGroup`` (Gloo, NCCL, ringtrain's sealed and TCP
    backends), seen from one member."""

    def rank(self) -> int:
        """This process's rank in the group."""
        ...

    def size(self) -> int:
        """The number of ranks in the group."""
        ...


class Store(Protocol):
    """A key-value store the ranks of a job share: torch's ``TCPStore``, ``HashStore`` or a
    ``PrefixStore`` over one. Values are written as ``str`` and read back as ``bytes``."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes:
        """The value under ``key``, waiting for it up to the store's timeout."""
        ...

    def check(self, keys: list[str]) -> bool:
        """Whether every key in ``keys`` exists now (never waits)."""
        ...

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        """Until every key in ``keys`` exists; raises past ``timeout``."""
        ...

    def delete_key(self, key: str) -> bool: ...

    def add(self, key: str, value: int) -> int:
        """Add ``value`` to the counter ``key`` (0 if it is not there); the sum."""
        ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (``""``: if it is not there);
        what ``key`` holds afterwards."""
        ...

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """What every later wait on this store (``get``, ``wait``) is bounded by."""
        ...


class Work(Protocol):
    """A collective under way: torch's ``Work``."""

    def wait(self, timeout: datetime.timedelta = ...) -> bool:
        """Until it is done; raises its error, or a timeout past ``timeout``."""
        ...

    def is_completed(self) -> bool:
        """Whether it is done (never waits)."""
        ...
