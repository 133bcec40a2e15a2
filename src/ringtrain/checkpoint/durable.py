"""Durable jobs: checkpoints on a schedule, and resuming a job whose ranks or launcher died.

    job = ringtrain.checkpoint.Durable(model=model, optimizer=opt, sampler=sampler)
    for step in range(job.start_step, total_steps):
        ...                                  # one optimizer step
        job.step(step + 1, extra={...})      # saves when the schedule says so
    job.close()                              # waits for the last save

Settings come from the Config (``ringtrain run --checkpoint-dir D --checkpoint-every 100|300s
--checkpoint-keep K``, or ``RINGTRAIN_CHECKPOINT_*``); ``ringtrain run --resume D`` loads the
newest complete checkpoint of ``D`` when the object is made (``start_step`` is then its step)
and keeps saving into ``D`` (into ``D``'s root where ``D`` is one ``root/step-N``) unless
``--checkpoint-dir`` says otherwise. Saves are asynchronous
(:class:`ringtrain.checkpoint.Checkpointer`). A schedule in seconds is decided by rank 0's
clock and broadcast, so every rank saves at the same step.

One directory holds one run: a job's checkpoints record its run id (``ringtrain run``'s job id,
or an id agreed at the first save; a resumed job takes over the id of the run it continues).
A new job whose checkpoint directory holds another run's checkpoints refuses to start
(:class:`ConfigError` on every rank, before any step): saving beside them, its keep-last would
remove them (or they its own), its steps would replace theirs, and a later ``--resume`` could
continue either run. Keep-last counts only this run's checkpoints.

A job that saves stops at a step on SIGTERM (a preemption, forwarded by the launcher;
Kubernetes and Slurm send it), where the script left Python's default, which ends the process at
once, the save in flight with it: every rank saves that step and raises ``SystemExit(143)``,
and ``with Durable(...)`` (or ``close()`` in a ``finally``) lets the save commit within the
launcher's grace period (:mod:`ringtrain.checkpoint.preemption`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from ringtrain import environ
from ringtrain.checkpoint import api, manifest, preemption, step_checks
from ringtrain.checkpoint.preemption import EXIT_CODE, Preemption
from ringtrain.checkpoint.writer import Checkpointer
from ringtrain.config import Config, checkpoint_schedule
from ringtrain.environ import Ringtrain
from ringtrain.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("ringtrain")


class Durable:
    """A training loop's checkpoints, configured by the job (see the module docstring)."""

    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: object = None,
        config: Config | None = None,
    ) -> None:
        self._rank, self._size, cfg = api._where()
        cfg = cfg if config is None else config
        # Resumed from root/step-N, the job keeps saving into root, beside the step.
        self.directory = cfg.checkpoint_dir or (
            manifest.save_root(cfg.resume) if cfg.resume else ""
        )
        self._every = checkpoint_schedule(cfg.checkpoint_every) if cfg.checkpoint_every else None
        if self._every is not None and not self.directory:
            raise ConfigError(
                "checkpoint_every is set but there is no checkpoint directory.\n"
                "HINT: ringtrain run --checkpoint-dir DIR --checkpoint-every N."
            )
        self._objects = (model, optimizer, sampler)
        self.start_step = 0
        self.restored: api.Restored | None = None
        # The launcher's job id is the same on every rank, and on ranks that join an elastic job
        # later, which must find the checkpoints already saved to be this run's own.
        self.run: str | None = environ.current().get(Ringtrain.JOB_ID) or None
        if cfg.resume:
            self.restored = api.load(cfg.resume, model=model, optimizer=optimizer, sampler=sampler)
            self.start_step = self.restored.step
            self.run = self.restored.run  # that run goes on: its checkpoints are this job's
        if self.directory:
            _refuse_other_runs(self.directory, self.run, cfg.resume)
        self._saver = (
            Checkpointer(
                self.directory, keep=cfg.checkpoint_keep, run=self.run, writer=cfg.checkpoint_writer
            )
            if self.directory
            else None
        )
        self._last_step = self.start_step
        self._last_time = time.monotonic()
        # Half the grace period to reach a step after SIGTERM, half to save it.
        grace_s = _grace_s(cfg.grace_period_s, self._saver is not None and self._rank == 0)
        self._preemption = Preemption(grace_s / 2, loud=self._rank == 0)
        # Elastic: the ranks not signalled go on in a smaller world once the save is handed over.
        self._elastic = Ringtrain.ELASTIC_ID in environ.current()
        self.stopped_at: int | None = None  # the step a preemption stopped the job at
        self._stopping = 0  # how many ranks got SIGTERM, agreed at that step
        # Every few steps, the ranks agree on a stop and on rank 0's clock (read at call time:
        # tests set this module's clock).
        self._checks = step_checks.StepChecks(clock=lambda: time.monotonic())
        if self._saver is not None:
            self._preemption.install()

    @property
    def extra(self) -> Any:
        """The ``extra`` of the checkpoint resumed from (None on a fresh start)."""
        return self.restored.extra if self.restored is not None else None

    def _verdict(self, step: int) -> tuple[bool, int]:
        """Whether a save is due at ``step``, and how many ranks were asked to stop (SIGTERM),
        the same on every rank: where there are peers, a schedule in seconds (rank 0's clock)
        and a stop are agreed every few steps (:mod:`.step_checks`)."""
        kind, n = self._every if self._every is not None else ("steps", 0)
        due = kind == "steps" and n > 0 and step - self._last_step >= n
        on_clock = kind == "seconds" and time.monotonic() - self._last_time >= n
        self._rank, self._size, _ = api._where()  # an elastic world may have re-formed
        if self._size == 1:
            agreed: step_checks.Agreed | None = step_checks.Agreed(
                on_clock, int(self._preemption.requested)
            )
        else:
            agreed = self._checks.at(step, on_clock, self._preemption.requested)
        if agreed is None:
            return due, 0
        if on_clock:
            self._last_time = time.monotonic()  # asked: not again before the answer (and the save)
        return due or agreed.on_clock, agreed.stopping

    def step(self, step: int, extra: object = None, force: bool = False) -> bool:
        """Call after optimizer step ``step`` (counting from 1): saves if due (or ``force``, or
        a rank was preempted: then raises ``SystemExit(143)`` once the save is handed over);
        returns whether it saved. Raises an earlier background save's failure."""
        if self._saver is None:
            return False
        self._saver.check()
        due, stopping = self._verdict(step)
        if not (due or force or stopping):
            return False
        model, optimizer, sampler = self._objects
        self._saver.save(
            step, model=model, optimizer=optimizer, sampler=sampler, extra=extra,
            urgent=stopping > 0,  # every rank: the stopping ranks wait for its commit
        )  # fmt: skip
        self._last_step, self._last_time = step, time.monotonic()
        if stopping and (self._preemption.requested or not self._elastic):
            self.stopped_at, self._stopping = step, stopping
            self._preemption.stop(step)
        return True

    def _stopped(self) -> None:
        """The line of a stop at a step, once its save committed: where the ranks were killed
        before (mpirun kills 1 s after its SIGTERM unless told otherwise), none claims it."""
        committed = self._saver.last_committed if self._saver is not None else None
        if self.stopped_at is None or not committed:
            return
        if os.path.basename(committed) == manifest.step_name(self.stopped_at):
            self._say_stop(self.stopped_at, self._stopping)

    def _say_stop(self, step: int, stopping: int) -> None:
        """This rank's line as the job (or, elastic, this rank) stops at ``step``, saved."""
        if self._elastic and stopping < self._size:  # not every rank: the others may go on
            head = "ringtrain: rank %d: SIGTERM (a preemption): this rank stops at step %d, saved"
            left, fewest = self._size - stopping, _fewest()
            if left >= fewest:
                log.warning(
                    head + " into %s with its peers, which go on without it (elastic)",
                    self._rank, step, self.directory,
                )  # fmt: skip
            else:  # the launcher stops them, or waits for hosts (--host-discovery-script)
                log.warning(
                    head + " into %s with its peers; %d rank(s) remain, fewer than --min-np %d: "
                    "the job goes on only if hosts join (continue with %s)",
                    self._rank, step, self.directory, left, fewest, _resume(self.directory),
                )  # fmt: skip
        elif self._rank == 0:
            log.warning(
                "ringtrain: rank 0: %d rank(s) got SIGTERM (a preemption): the job stops at "
                "step %d, saved into %s (continue with %s)",
                stopping, step, self.directory, _resume(self.directory),
            )  # fmt: skip

    def close(self) -> None:
        """Wait for the last save and stop the writer. Where a SIGTERM came after the last
        step, raises its ``SystemExit(143)`` once that save committed."""
        self._close(raising=True)

    def _close(self, raising: bool, settle: bool = True) -> None:
        self._preemption.closing()  # a SIGTERM now is noted: the wait for the save goes on
        try:
            if settle:
                self._checks.settle()
            if self._saver is not None:
                self._saver.close()
                self._stopped()
        finally:
            self._preemption.closed()
        if raising and self._preemption.requested and self.stopped_at is None:
            self.stopped_at = self._last_step
            preemption.said(self._last_step)  # as Preemption.stop: its last step saved
            raise SystemExit(EXIT_CODE)

    def __enter__(self) -> Durable:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        # Never raised in place of the error the block ended with; after an error, the last
        # step's agreement is not waited for (the peers may never ask theirs).
        self._close(raising=kind is None, settle=kind is None or self.stopped_at is not None)


def _refuse_other_runs(directory: str, run: str | None, resumed_from: str) -> None:
    """Raise :class:`ConfigError` if ``directory`` holds committed checkpoints of a run other
    than ``run`` (None: a new run, which has saved nothing yet). Every rank reads the same
    directory before any of them can have saved, so every rank decides alike."""
    theirs = [step for step, _ in manifest.of_other_runs(directory, run)]
    if not theirs:
        return
    steps = ", ".join(map(str, theirs)) if len(theirs) <= 4 else f"{theirs[0]} to {theirs[-1]}"
    held = f"{directory} holds {len(theirs)} checkpoint(s) of another run (step {steps})"
    if not resumed_from:
        raise ConfigError(
            f"{held}, and this new job (no --resume) would delete or overwrite them.\n"
            f"HINT: continue that run with --resume {directory} (RINGTRAIN_RESUME), or give this "
            "job a fresh directory: --checkpoint-dir NEW_DIR (RINGTRAIN_CHECKPOINT_DIR)."
        )
    raise ConfigError(
        f"{held} than the one resumed from {resumed_from}, which this job would delete or "
        f"overwrite.\nHINT: save into the directory resumed from (leave out --checkpoint-dir), "
        "or give --checkpoint-dir a fresh directory."
    )


def _fewest() -> int:
    """The fewest ranks this elastic job goes on with (``--min-np``, from its launcher)."""
    return int(environ.current().get(Ringtrain.ELASTIC_MIN_NP) or 1)


def _resume(directory: str) -> str:
    """How to continue from ``directory``: ``ringtrain run``'s flag where it started this rank
    (its heartbeat pipe), else the variable (torchrun, mpirun, Slurm, Kubernetes)."""
    if environ.current().get(Ringtrain.HEARTBEAT_FD):
        return f"--resume {directory}"
    return f"RINGTRAIN_RESUME={directory} in the next start's environment"


def _grace_s(configured_s: float, say: bool) -> float:
    """The time a rank has after a SIGTERM: the grace period, or less under mpirun or torchrun,
    which SIGKILL their ranks a fixed time after it (``say``: warn where that is shorter)."""
    fixed = preemption.launcher_grace_s()
    if fixed is None or fixed[1] >= configured_s:
        return configured_s
    launcher, left_s = fixed
    if say:
        log.warning(
            "ringtrain: rank 0: under %s, a SIGTERM (a preemption) reaches the ranks with %g s "
            "left before %s's SIGKILL, less than the grace period of %g s to stop at one step "
            "and save it: they take %g s.\nHINT: %s",
            launcher, left_s, launcher, configured_s, left_s, _LONGER[launcher] % configured_s,
        )  # fmt: skip
    return left_s


# How to give the ranks the grace period, by launcher.
_LONGER = {
    "mpirun": "mpirun --mca odls_base_sigkill_timeout %g (or a shorter RINGTRAIN_GRACE_PERIOD_S); "
    "mpirun passes a SIGTERM on that long after its own, so the preemption's own grace (Slurm's "
    "KillWait, a pod's terminationGracePeriodSeconds) must cover twice that.",
    "torchrun": "torchrun's time is fixed (%g s asked): set RINGTRAIN_GRACE_PERIOD_S to at most "
    "30, or start one rank per pod without torchrun (ringtrain k8s: slots: 1).",
}
