"""Asynchronous saves: training waits only while its tensors are copied to host memory.

:class:`Checkpointer` copies this rank's part into buffers and hands them to its writer (a
process of its own, :mod:`ringtrain.checkpoint.process_writer`, or where no process may start, a
thread, :mod:`ringtrain.checkpoint.thread_writer`; a preemption's save always a thread), and
returns. Nothing in that blocking part waits for other ranks after a world's first save: the
save id is a prefix agreed at that first save and a count of saves. Each writer writes its
rank's part; rank 0's then commits the checkpoint (:mod:`ringtrain.checkpoint.store`). One save
is in flight at a time: a save while the previous one still writes first waits for it (that wait
is blocked time, reported by :attr:`Checkpointer.last_blocked_s`). A write that failed is raised as
:class:`CheckpointError` at the next :meth:`Checkpointer.save`, :meth:`~Checkpointer.check` or
:meth:`~Checkpointer.wait`; a writer process that died is such a failure too.
:meth:`~Checkpointer.wait` returns once the save is committed, on every rank: the other ranks
read rank 0's outcome from the save's directories (:func:`ringtrain.checkpoint.peers.await_commit`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import weakref

import torch

from ringtrain.checkpoint import api, interrupts, manifest, peers, store
from ringtrain.checkpoint.process_writer import ProcessWriter
from ringtrain.checkpoint.store import GIVEN_UP
from ringtrain.checkpoint.thread_writer import ThreadWriter
from ringtrain.config import CHECKPOINT_WRITERS
from ringtrain.errors import CheckpointError, ConfigError

log = logging.getLogger("ringtrain")


class Checkpointer:
    """Periodic asynchronous checkpoints into ``root`` (``root/step-N``), keeping the newest
    ``keep`` (0: all) of its run. Collective like :func:`ringtrain.checkpoint.save`.

    Its checkpoints record a run id: ``run``, or else the id agreed at its first save. Keep-last
    counts and removes only that run's checkpoints, and a save never replaces another run's
    checkpoint of the same step (it fails instead): other checkpoints in ``root`` are left as
    they are. To continue a run loaded from ``root``, pass ``run=restored.run``.

    ``writer``: ``"process"`` (a writer process, shared-memory buffers), ``"thread"`` (a thread
    of this process, private buffers: for enclaves), or ``"auto"``: the thread where this rank's
    collectives run on ringtrain's TCP transport, else the process (decided at the first save).
    None: the job's ``checkpoint_writer`` setting (``RINGTRAIN_CHECKPOINT_WRITER``)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep: int = 0,
        run: str | None = None,
        writer: str | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.keep = keep
        self.run = run
        self.writer = api._where()[2].checkpoint_writer if writer is None else writer
        if self.writer not in CHECKPOINT_WRITERS:
            raise ConfigError(
                f"writer must be one of {', '.join(CHECKPOINT_WRITERS)}, got {self.writer!r}"
            )
        self._writer: ProcessWriter | ThreadWriter | None = None
        # A stop's save (``urgent``) is written on a thread of this rank beside a writer process:
        # the writer process, at nice +19, can get too little of a busy host's cores to write
        # within a preemption's grace period; training is over (or waits for it) by then.
        self._spare: ThreadWriter | None = None
        self._by: ProcessWriter | ThreadWriter | None = None  # the writer of the save in flight
        self._token: str | None = None  # this world's save-id prefix (agreed once per world)
        self._world: tuple[int, int] | None = None
        self._saves = 0  # saves in this world: the same count on every rank
        self._inflight: store.Job | None = None  # the save this rank's writer is at
        self._lookout: peers.Lookout | None = None  # rank 0: for its peers that left meanwhile
        # Other ranks: the save whose part this rank wrote and whose commit (rank 0's) it has
        # not learnt yet; wait() waits for that word.
        self._unconfirmed: store.Job | None = None
        self._failure: str | None = None
        self.last_blocked_s = 0.0
        self.last_phases: dict[str, float] = {}  # where last_blocked_s went (seconds)
        self.last_committed: str | None = None

    # ---- the writer ----------------------------------------------------------------------------

    @property
    def buffer_dir(self) -> str | None:
        """The shared-memory buffers' directory (made at the first save; process writer)."""
        return self._writer.shm if isinstance(self._writer, ProcessWriter) else None

    @property
    def writer_pid(self) -> int | None:
        return self._writer.pid if isinstance(self._writer, ProcessWriter) else None

    @property
    def writer_kind(self) -> str | None:
        """``"process"`` or ``"thread"``: the writer chosen at the first save."""
        return self._writer.kind if self._writer is not None else None

    def _made_writer(self) -> ProcessWriter | ThreadWriter:
        """The writer, chosen once (at the first save: ``auto`` needs the running job)."""
        if self._writer is not None:
            return self._writer
        kind, why = self._kind()
        log.info("checkpoints into %s: the %s writer (%s)", self.root, kind, why)
        # Rank 0 commits (a rank 0 of a later elastic world imports DCP at its first commit).
        rank, _, cfg = api._where()
        self._writer = (
            ThreadWriter()
            if kind == "thread"
            else ProcessWriter(commits=rank == 0, buffers=cfg.checkpoint_buffers)
        )
        _unclosed.add(self)
        return self._writer

    def _kind(self) -> tuple[str, str]:
        """The writer this rank takes (``"process"`` or ``"thread"``), and why."""
        if self.writer != "auto":
            return self.writer, "asked for"
        from ringtrain.transport import tcp_backend

        if tcp_backend.configured():
            return "thread", (
                "auto: this rank's collectives run on ringtrain's TCP transport, as in enclaves, "
                "where no process may start"
            )
        return "process", "auto: a low-priority process keeps the training steps fast"

    def _urgent_writer(self) -> ThreadWriter:
        """A thread writer: the job's own, else one beside its writer process, made or not
        (see ``_spare``: a stop is no time to start a process)."""
        if self._writer is not None or self._kind()[0] == "thread":
            writer = self._made_writer()
            if isinstance(writer, ThreadWriter):
                return writer
        if self._spare is None:
            log.info("ringtrain: a preemption's save: written on this rank's own thread")
            self._spare = ThreadWriter()
            _unclosed.add(self)
        # The writer process's buffers, where it has them (nothing is in flight: _save collected
        # it): a second copy of the state could exceed the pod's memory as it is preempted.
        process = self._writer
        self._spare.lender = process.lend if isinstance(process, ProcessWriter) else None
        return self._spare

    def _collect(self, block: bool) -> None:
        """Take the in-flight save's outcome, if it is known (or wait for it). Rank 0 meanwhile
        notes the peers that left, whose parts its writer would wait for until the timeout."""
        if self._inflight is None or self._by is None:
            return
        writer, lookout = self._by, self._lookout if block else None  # check(): no reads
        arrived = writer.wait(0.0)  # asked first: a step's check() costs no section
        while not arrived:
            if not block:
                return
            if lookout is not None:
                lookout.look()
            arrived = writer.wait(peers.EVERY_S if lookout is not None else None)
        with interrupts.deferred():  # an outcome taken is an outcome recorded
            got = writer.outcome()
            if got is not None:
                self._collected(got)
                if writer is self._spare:  # its buffers: a copy of the state, freed until needed
                    writer.close()

    def _collected(self, got: tuple[str, str]) -> None:
        job, self._inflight, self._lookout = self._inflight, None, None
        assert job is not None
        if got[0] == "ok" and job.rank != 0:
            self._unconfirmed = job  # its part only: rank 0 commits
        else:
            self._take(job, got)

    def _confirm(self, block: bool) -> None:
        """Take rank 0's word on the save this rank (not rank 0) wrote its part of: waited for,
        or only if it is there already. Not waited for once the world re-formed (or shut down)
        since: that world's rank 0 may be gone, and no departure of this world would say so."""
        job = self._unconfirmed
        if job is None:
            return
        got = store.verdict(job)
        if got is None and block and api.world() == self._world:
            got = peers.await_commit(job)
        self._unconfirmed = None if got is not None or block else job
        if got is not None:
            self._take(job, got)

    def _take(self, job: store.Job, got: tuple[str, str]) -> None:
        status, value = got
        if status == "ok":
            self.last_committed = value
        elif status == GIVEN_UP:  # said, not raised: the peer's departure is the failure
            log.warning("ringtrain: %s", value)
        else:
            self._failure = f"the background save into {job.final} failed: {value}"

    def check(self) -> None:
        """Raise the failure of an earlier background save, if one failed (once)."""
        self._collect(block=False)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            if "\nHINT:" in failure:  # the writer's own error says what to do
                raise CheckpointError(failure)
            raise CheckpointError(
                f"{failure}\nHINT: earlier checkpoints are untouched; fix the cause (space, "
                "permissions) and save again."
            )

    def in_flight(self) -> bool:
        """Whether this rank's part of a background save is still being written (does not raise
        its failure; on ranks other than 0, the commit is :meth:`wait`'s)."""
        self._collect(block=False)
        return self._inflight is not None

    def wait(self) -> str | None:
        """Wait for the save in flight to be committed (on every rank: rank 0 commits it once
        every part is written); returns the newest committed checkpoint's path. A save that
        failed raises here, on every rank; one given up (a rank left) is logged."""
        self._collect(block=True)
        self._confirm(block=True)
        self.check()
        return self.last_committed

    def close(self) -> None:
        """Wait for the save in flight, then stop the writer and free the buffers."""
        try:
            self.wait()
        finally:
            _unclosed.discard(self)
            if self._spare is not None:
                self._spare.close()
            if isinstance(self._writer, ProcessWriter):
                # After a stop's save, with nothing in flight: the grace period is short.
                self._writer.close(at_once=self._spare is not None and self._inflight is None)
            elif self._writer is not None:
                self._writer.close()

    # ---- saving ------------------------------------------------------------------------------

    def _save_id(self) -> str:
        """This save's id, the same on every rank without a collective in the blocking part:
        a random prefix agreed once per world (at its first save, which also checks that the
        ranks' roots are the same), then a count of saves.
        Ranks that disagree (one skipped a save) write parts under different ids, which the
        committing writer never mixes: the save fails, named, at the next save."""
        world = api.world()
        if self._token is None or self._world != world:
            self._token, self._world, self._saves = api.new_token(self.root), world, 0
            if self.run is None:  # the run is this object's, across elastic re-formings
                self.run = self._token
        self._saves += 1
        return f"{self._token}-{self._saves}"

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: object = None,
        extra: object = None,
        urgent: bool = False,
    ) -> None:
        """Start saving ``root/step-<step>``: returns once this rank's part is in host memory.
        Raises the failure of the previous background save, if it failed. ``urgent`` (a
        preemption's save, on every rank): written on a thread of this rank, at its priority,
        where the writer is a process (the same on every rank: rank 0's writer commits).

        A Ctrl-C or a durable job's SIGTERM that comes meanwhile is raised once this save is
        handed over: the rank it finds here is the one still waiting for its writer, whose peers
        handed this save over already, and a save some ranks never hand over cannot commit. A
        second one is raised at once."""
        with interrupts.deferred(insist=True):
            handed_over = self._save(step, model, optimizer, sampler, extra, urgent)
        if not handed_over:
            # The previous save failed: raised here, after the section, so that an interruption
            # handled at its end does not hide it (the failure stays for close() to raise).
            self.check()

    def _save(
        self,
        step: int,
        model: torch.nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        sampler: object,
        extra: object,
        urgent: bool,
    ) -> bool:
        t0 = time.perf_counter()
        self._collect(block=True)  # one save in flight: the previous one must be done
        self._confirm(block=False)  # rank 0's word on it, if in; not waited for (wait() does)
        self._unconfirmed = None
        if self._failure is not None:
            return False
        writer = self._urgent_writer() if urgent else self._made_writer()
        writer.ready()
        t1, c1 = time.perf_counter(), time.process_time()
        save_id = self._save_id()
        final = os.path.join(self.root, manifest.step_name(step))
        job, items, keys = api.prepare(
            final, step, self.keep, model, optimizer, sampler, extra, writer.host, save_id, self.run
        )
        t2, c2 = time.perf_counter(), time.process_time()
        lookout = peers.Lookout.of(job)
        with interrupts.deferred():  # a save handed over is a save close() waits for
            writer.submit(job, items, keys)
            self._inflight, self._lookout, self._by = job, lookout, writer
        t3 = time.perf_counter()
        self.last_blocked_s = t3 - t0
        self.last_phases = {
            "previous": t1 - t0,
            "copy": t2 - t1,
            "copy_cpu": c2 - c1,  # CPU time (all threads): the work, not the load
            "handoff": t3 - t2,
        }
        return True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Checkpointers with a writer that were not closed. A script that saves at its last step and
# ends without close() (no ``with``) lost that save: the writer process died with the rank
# (PR_SET_PDEATHSIG), the writer thread is a daemon, and the exit code was 0.
_unclosed: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _close_at_exit() -> None:
    """atexit: close every Checkpointer left open, so the save in flight commits (as Python
    waits for a ThreadPoolExecutor's work) and its buffers are freed. Not in a rank that is
    failing (an uncaught exception): it leaves at once with its own exit code."""
    from ringtrain.runtime import departures  # not at import: the writer process imports this

    if departures.failure() is not None:
        return
    for saver in list(_unclosed):
        try:
            if saver.in_flight():
                log.info("ringtrain: waiting for the save in %s at exit", saver.root)
            saver.close()
        except Exception as e:  # nobody is left to raise to: say it where the job's output is
            sys.stderr.write(f"ringtrain: at exit: {e}\n")


atexit.register(_close_at_exit)
