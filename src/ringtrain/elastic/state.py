"""Horovod's elastic state: what a job keeps in memory so it can roll back and re-form.

``commit()`` copies the tracked values to host memory and checks whether the launcher announced
new hosts; ``restore()`` rolls back to the last commit (after a peer failed mid-step);
``sync()`` makes every rank hold rank 0's values (after the world was re-formed). The collective
functions are injected, so this module is plain Python and testable without a job.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from ringtrain.errors import HostsUpdatedInterrupt

T = TypeVar("T")

# The newest membership generation this process's world has been re-formed to: one for every
# state, since any state's commit() may be what raised for it (a second state, committed beside
# the one given to @elastic.run, must not raise again for a generation already handled).
_handled = 0


class Broadcast(Protocol):
    def __call__(self, obj: T, /) -> T:
        """Rank 0's object on every rank."""
        ...


class Gather(Protocol):
    def __call__(self, obj: T, /) -> list[T]:
        """Every rank's object, in rank order."""
        ...


class State:
    """Base of the elastic states: reset callbacks and host-update checks.

    ``updates`` is asked, at each check, for the newest membership generation the launcher has
    announced (``None`` when no launcher announces any); ``gather`` combines what each rank saw,
    so all ranks raise :class:`HostsUpdatedInterrupt` together, even if rank 0 saw nothing yet.
    """

    def __init__(self, gather: Gather, updates: Callable[[], int | None] | None = None) -> None:
        self._gather = gather
        self._updates = updates
        self._reset_callbacks: list[Callable[[], None]] = []
        self._seen_update = 0
        self._pending_update = 0

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Run ``callbacks`` after every reset (a rank left or joined), e.g. to rescale the LR."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by ``@elastic.run`` once the new world is formed, before ``sync()``: the
        state's own :meth:`reset`, then the registered callbacks (Horovod's order)."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self) -> None:
        """Reset what the state holds after a reset event, before the sync; a subclass's hook
        (Horovod's), nothing here."""

    def on_hosts_updated(self, generation: int) -> None:
        """Note that the launcher announced membership ``generation``."""
        self._pending_update = max(self._pending_update, generation)

    def commit(self) -> None:
        """Save the tracked values, then :meth:`check_host_updates`.

        Commits copy every tracked tensor: commit every few batches, trading copy time against
        the work lost when a peer fails.
        """
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if any rank saw an announcement."""
        if self._updates is not None:
            announced = self._updates()
            if announced is not None:
                self.on_hosts_updated(announced)
        newest = max(self._gather(self._pending_update))
        if newest > max(self._seen_update, _handled):
            self._seen_update = newest
            raise HostsUpdatedInterrupt(skip_sync=False)

    def mark_generation(self, generation: int) -> None:
        """The world now is ``generation``: announcements up to it are handled, for every
        state of this process."""
        global _handled
        _handled = max(_handled, generation)
        self._seen_update = max(self._seen_update, generation)
        self._pending_update = max(self._pending_update, generation)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Plain Python values, given as keyword arguments and exposed as attributes."""

    def __init__(
        self,
        broadcast: Broadcast,
        gather: Gather,
        updates: Callable[[], int | None] | None = None,
        **values: object,
    ) -> None:
        self._broadcast = broadcast
        self._saved_state: dict[str, object] = copy.deepcopy(values)
        super().__init__(gather, updates)
        self._set_attrs()

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._broadcast(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))
