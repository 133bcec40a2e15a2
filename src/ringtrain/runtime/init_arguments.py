"""Horovod's ``init(comm=None, process_sets=None)`` arguments, read the way ringtrain can honour
them.

``comm`` chooses Horovod's world: a list of MPI ranks or an MPI communicator. ringtrain's world
is every rank its launcher started, numbered as the launcher numbered them, so ``comm`` is
accepted only where it names that world (all ranks, or a communicator of the job's size that
numbers every rank as the job does) and is refused with a clear error otherwise, never quietly
widened or renumbered. ``process_sets="dynamic"`` is accepted: ringtrain always allows
``add_process_set`` after ``init()``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Protocol, TypeGuard

from ringtrain.errors import ConfigError, ConfigTypeError
from ringtrain.runtime.process_sets import ProcessSet, is_mpi_comm

ProcessSets = Sequence[ProcessSet | Sequence[int]]


class MpiComm(Protocol):
    """What ringtrain reads of an mpi4py communicator."""

    def Get_size(self) -> int: ...  # mpi4py's names

    def Get_rank(self) -> int: ...


Comm = Sequence[int] | MpiComm | None

_HINT = (
    "HINT: start only the ranks you need (-np), or keep the whole world and make a process set: "
    "hvd.init(process_sets=[hvd.ProcessSet([0, 1])])."
)


def process_sets_of(process_sets: ProcessSets | str | None) -> ProcessSets:
    """The sets to register at ``init()``; ``"dynamic"`` (any case) registers none."""
    if process_sets is None:
        return ()
    if isinstance(process_sets, str):
        if process_sets.lower() == "dynamic":
            return ()
        raise ConfigError(
            f'init(process_sets={process_sets!r}): the only string taken is "dynamic".\n'
            "HINT: give a list of ProcessSet objects or rank lists, or leave it out."
        )
    return process_sets


def check_comm_type(comm: object) -> None:
    """Before joining: ``comm`` is None, a list of ranks or an MPI communicator."""
    if comm is None or _is_mpi_comm(comm):
        return
    if isinstance(comm, Sequence) and not isinstance(comm, (str, bytes)):
        for i, r in enumerate(comm):
            if not _is_int(r):  # Horovod's (ctypes.c_int * n)(*comm) raises TypeError
                raise ConfigTypeError(
                    f"init(comm={comm!r}): comm's ranks must be ints; item {i} is {r!r} "
                    f"({type(r).__name__}).\nHINT: give ranks as ints, e.g. comm=[0, 1], or leave "
                    "comm out to use every rank of the job."
                )
        return
    raise ConfigError(
        f"init(comm={comm!r}): comm is a list of ranks or an MPI communicator, as in Horovod.\n"
        "HINT: leave it out to use every rank of the job."
    )


def check_comm(comm: Comm, size: int, gather: Callable[[int], list[int]]) -> None:
    """After joining, on every rank alike: ``comm`` names this job's whole world of ``size``
    ranks. ``gather`` is the collective that gives every rank's int, in job rank order: a
    communicator's numbering is compared with the job's (Horovod's ranks would be the
    communicator's; ringtrain's are the launcher's)."""
    if comm is None:
        return
    if isinstance(comm, Sequence):
        if sorted(comm) != list(range(size)):
            raise ConfigError(
                f"init(comm={list(comm)}): ringtrain's world is every rank its launcher started "
                f"(0-{size - 1}); a subset of them cannot be the world.\n{_HINT}"
            )
        return
    if comm.Get_size() != size:
        raise ConfigError(
            f"init(comm=...): the communicator has {comm.Get_size()} ranks, the job "
            f"{size}; ringtrain's world is every rank its launcher started.\n{_HINT}"
        )
    theirs = gather(comm.Get_rank())
    if theirs != list(range(size)):
        moved = ", ".join(f"{r} is its {c}" for r, c in enumerate(theirs) if r != c)
        raise ConfigError(
            f"init(comm=...): the communicator numbers the ranks differently from the job (job "
            f"rank {moved}); ringtrain's ranks are its launcher's, and hvd.rank() would not be "
            "comm.Get_rank().\nHINT: give MPI.COMM_WORLD, or a communicator split with "
            "key=rank, or leave comm out."
        )


def _is_int(r: object) -> bool:
    """An int, or an integer of numpy or torch (ctypes takes them too); never a bool."""
    if isinstance(r, bool):
        return False
    try:
        operator.index(r)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def _is_mpi_comm(comm: object) -> TypeGuard[MpiComm]:
    return is_mpi_comm(comm)
