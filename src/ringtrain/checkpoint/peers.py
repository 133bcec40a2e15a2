"""Rank 0's look-out for the ranks whose parts a background save still lacks.

Rank 0's writer commits a save once every rank's part is in its directory
(:func:`ringtrain.checkpoint.store.commit`). A rank that left the job will never write its part,
and the writer, which cannot read the job's store (it is a process of its own), waited out the
transport timeout (``timeout_s``, 300 s by default) for it: at ``close()``, at exit, or at the
next save, long after the job's departures (:mod:`ringtrain.runtime.departures`) said the rank
was gone. So rank 0's training process, while it waits for a save, reads them for the ranks
whose parts are missing, and leaves a note in the save's directory for each rank known gone; the
writer gives the save up when a rank whose part it lacks has one. A part written before its rank
left is still committed.

The other ranks, once their part is written, wait in ``Checkpointer.wait()`` for rank 0's word
on the save (:func:`await_commit`, reading :func:`ringtrain.checkpoint.store.verdict`), and
read the departures for rank 0 meanwhile: a rank 0 that left never commits it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

from ringtrain.checkpoint import layout, store

if TYPE_CHECKING:  # the runtime is imported where used: the writer process imports this module
    from ringtrain.runtime.contracts import Store
    from ringtrain.runtime.processes import Known

log = logging.getLogger("ringtrain")

EVERY_S = 1.0  # how often the departures are read while a save is in flight
# A rank that posted a failure ends within seconds (its at-exit work waits for nothing; its
# shutdown, at most 3 s); its writer may finish its part meanwhile. Where its end is recorded
# (`ringtrain run`), that record comes first.
FAILING_SETTLE_S = 10.0


class Departed:
    """The ranks among those asked about that left the job, read from the job's departures at
    most every :data:`EVERY_S`: a rank whose end is recorded at once, one that posted a failure
    once it has settled (:data:`FAILING_SETTLE_S`). Never raises: a store that went with the job
    leaves the caller's timeout to decide."""

    def __init__(self, world_store: Store) -> None:
        self._store: Store | None = world_store
        self._client: Store | None = None
        self._failing: dict[int, float] = {}  # rank: when its failure was first read
        self._present: Known = {}  # the ranks' process posts, read once each
        self._next = time.monotonic() + EVERY_S

    @staticmethod
    def of_world() -> Departed | None:
        """The reader of this job's departures, where the job has a store to read."""
        from ringtrain.runtime import state

        if not state.is_initialized():
            return None
        world = state.global_process_set.communicator.store
        return None if world is None else Departed(world)

    def among(self, ranks: list[int]) -> dict[int, str]:
        """``{rank: how it left}`` for those of ``ranks`` known gone, if it is time to read."""
        from ringtrain.runtime import departures

        now = time.monotonic()
        if self._store is None or now < self._next or not ranks:
            return {}
        self._next = now + EVERY_S
        try:
            if self._client is None:
                self._client = departures.reader(self._store)
            found = departures.gone(self._client, ranks, self._present)
        except Exception as e:  # the store went with the job: the caller's timeout stands
            log.debug("checkpoint: cannot read the departures any more: %s", e)
            self._store = None
            return {}
        out = {}
        for rank, (why, ended) in found.items():
            since = self._failing.setdefault(rank, now)
            if ended or now - since >= FAILING_SETTLE_S:
                out[rank] = why
        return out


class Lookout:
    """Reads the departures of the ranks whose parts one save lacks, at most every
    :data:`EVERY_S`, and notes each that is gone in the save's directory."""

    def __init__(self, job: store.Job, departed: Departed) -> None:
        self._job = job
        self._departed = departed
        self._noted: set[int] = set()

    @staticmethod
    def of(job: store.Job) -> Lookout | None:
        """Rank 0's look-out for ``job``, where there are peers and a store to read."""
        departed = Departed.of_world() if job.rank == 0 and job.size > 1 else None
        return None if departed is None else Lookout(job, departed)

    def look(self) -> None:
        """Note the ranks that left, if it is time to read again; never raises."""
        for rank, why in self._departed.among(self._lacking()).items():
            self._note(rank, why)

    def _lacking(self) -> list[int]:
        """The ranks whose parts are not in the save's directory yet, and not noted."""
        try:
            there = set(os.listdir(self._job.partial))
        except OSError:  # not made yet, or committed
            return []
        return [
            r
            for r in range(1, self._job.size)
            if r not in self._noted and layout.part_file(r) not in there
        ]

    def _note(self, rank: int, why: str) -> None:
        """Leave the note where the writer looks, in the save's directory, once it exists (the
        writer makes it; a directory made here could outlive a save that commits)."""
        partial = self._job.partial
        if not os.path.isdir(partial):
            return
        path = os.path.join(partial, layout.left_file(rank))
        with contextlib.suppress(OSError):  # committed meanwhile: nothing waits for it
            with open(path + ".tmp", "w") as f:
                f.write(why)
            os.replace(path + ".tmp", path)
            self._noted.add(rank)


def await_commit(job: store.Job) -> tuple[str, str]:
    """Rank 0's outcome of ``job``, for a rank other than 0 whose part of it is written: as
    :func:`ringtrain.checkpoint.store.verdict` finds it; given up once rank 0 is known gone;
    an error after ``job.timeout_s`` without a word."""
    departed = Departed.of_world()
    deadline = time.monotonic() + job.timeout_s
    pause = 0.02
    while True:
        got = store.verdict(job)
        gone = departed.among([0]) if departed is not None and got is None else {}
        if gone:
            got = store.verdict(job) or (  # it may have committed before it left
                store.GIVEN_UP,
                f"the save into {job.final} was not committed: rank 0 left the job before "
                f"committing it ({gone[0]}). It stays uncommitted in {job.partial}, as after a "
                "crash; earlier checkpoints are untouched.",
            )
        if got is not None:
            return got
        if time.monotonic() > deadline:
            return "error", (
                f"rank 0 did not commit the save into {job.final} within {job.timeout_s:g} s "
                "of this rank's part.\nHINT: rank 0 is stuck or gone (its output says which), "
                "or cannot reach this directory (ranks on several hosts need a shared file "
                "system)."
            )
        time.sleep(pause)
        pause = min(0.25, pause * 1.5)
