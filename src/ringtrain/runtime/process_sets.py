"""Process sets: named subsets of ranks that run their own collectives, as in Horovod.

A :class:`ProcessSet` is a plain description (its ranks) until it is registered; registration
(:func:`ringtrain.add_process_set`, or ``init(process_sets=...)``) is collective over the whole
world, because ``torch.distributed.new_group`` must be called by every rank in the same order.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ringtrain.errors import CollectiveArgumentError, NotInitializedError

if TYPE_CHECKING:
    from ringtrain.runtime.communicator import Communicator


def is_mpi_comm(obj: object) -> bool:
    """Whether ``obj`` looks like an mpi4py communicator (Horovod's functions take one)."""
    return hasattr(obj, "Get_size") and hasattr(obj, "Get_rank")


def _ranks_of(ranks_or_comm: object) -> Iterable[int]:
    """The ranks a ``ProcessSet`` argument names; an MPI communicator gets a clear error:
    ringtrain's world need not be MPI's, so its ranks are asked for instead."""
    if is_mpi_comm(ranks_or_comm):
        raise CollectiveArgumentError(
            f"ProcessSet({type(ranks_or_comm).__name__}): ringtrain makes process sets from "
            "ranks, not from MPI communicators.\n"
            "HINT: pass the communicator's world ranks, e.g. "
            "hvd.ProcessSet(comm.allgather(hvd.rank()))."
        )
    if not isinstance(ranks_or_comm, Iterable) or isinstance(ranks_or_comm, (str, bytes)):
        raise CollectiveArgumentError(
            f"ProcessSet takes a list of ranks, got {ranks_or_comm!r}.\n"
            "HINT: e.g. hvd.ProcessSet([0, 2])."
        )
    return ranks_or_comm


def _rank_numbers(ranks: Iterable[object]) -> list[int]:
    """The ranks as ints. A float or a string is refused, as Horovod's ValueError refuses
    anything not an int: int(1.5) would quietly name rank 1. Integers of numpy or torch pass."""
    numbers = []
    for r in ranks:
        try:
            numbers.append(operator.index(r))  # type: ignore[arg-type]
        except TypeError:
            raise CollectiveArgumentError(
                f"ProcessSet takes a list of integer ranks, got {r!r} ({type(r).__name__}).\n"
                "HINT: pass ints, e.g. hvd.ProcessSet([0, 2])."
            ) from None
    return numbers


class ProcessSet:
    """A subset of the world's ranks. ``ProcessSet(None)`` stands for the whole world."""

    def __init__(self, ranks_or_comm: Iterable[int] | None = None) -> None:
        if ranks_or_comm is None:
            self._ranks: tuple[int, ...] | None = None
        else:
            ranks = _rank_numbers(_ranks_of(ranks_or_comm))
            if len(set(ranks)) != len(ranks):
                raise CollectiveArgumentError(f"process set ranks must be distinct, got {ranks}")
            if not ranks:
                raise CollectiveArgumentError("a process set needs at least one rank")
            self._ranks = tuple(sorted(ranks))
        self.process_set_id: int | None = None
        self._communicator: Communicator | None = None

    @property
    def ranks(self) -> list[int]:
        if self._ranks is None:
            if self._communicator is None:
                raise NotInitializedError("ProcessSet.ranks of the global set")
            return list(self._communicator.ranks)
        return list(self._ranks)

    def _bind(self, set_id: int, communicator: Communicator) -> None:
        self.process_set_id = set_id
        self._communicator = communicator

    def _unbind(self) -> None:
        self.process_set_id = None
        self._communicator = None

    @property
    def communicator(self) -> Communicator:
        if self._communicator is None:
            raise CollectiveArgumentError(
                f"{self!r} is not registered.\n"
                "HINT: pass it to ringtrain.init(process_sets=[...]) or call "
                "ringtrain.add_process_set() on every rank first."
            )
        return self._communicator

    # As Horovod's: a set not registered (yet, or any more) answers None rather than raising,
    # included() of its known ranks; the global set, always registered there, raises before
    # init() and after shutdown() as hvd.size() does.

    def _registered(self, query: str) -> Communicator | None:
        if self._communicator is None and self._ranks is None:
            raise NotInitializedError(f"global_process_set.{query}()")
        return self._communicator

    def included(self) -> bool | None:
        """Whether this process is a member."""
        comm = self._registered("included")
        if comm is not None:
            return comm.included
        world = global_process_set._registered("included")
        return world is not None and world.world_rank in (self._ranks or ())

    def size(self) -> int | None:
        """The number of ranks in the set; None while it is not registered."""
        comm = self._registered("size")
        return None if comm is None else len(comm.ranks)

    def rank(self) -> int | None:
        """This process's rank within the set; None while it is not registered, and an error
        on a rank that is not a member."""
        comm = self._registered("rank")
        return None if comm is None else comm.set_rank

    def __repr__(self) -> str:
        who = "global" if self._ranks is None else list(self._ranks)
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={who})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ProcessSet) and self._ranks == other._ranks

    def __hash__(self) -> int:
        return hash(self._ranks)


# The whole world's set, bound by init() and unbound by shutdown(): hvd.global_process_set.
global_process_set = ProcessSet(None)
