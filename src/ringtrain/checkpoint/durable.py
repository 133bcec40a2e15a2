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

A job that saves turns SIGTERM (a preemption, forwarded by the launcher; Kubernetes and Slurm
send it) into ``SystemExit(143)`` where the script left Python's default, which ends the
process at once, the save in flight with it (its writer dies with the rank). The script then
unwinds as on Ctrl-C, and ``with Durable(...)`` (or ``close()`` in a ``finally``) lets that save
commit within the launcher's grace period. A second SIGTERM ends the process at once.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from ringtrain import environ
from ringtrain.checkpoint import api, manifest
from ringtrain.checkpoint.writer import Checkpointer
from ringtrain.config import Config, checkpoint_schedule
from ringtrain.environ import Ringtrain
from ringtrain.errors import ConfigError

if TYPE_CHECKING:
    import torch


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
        _, self._size, cfg = api._where()
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
        if self._saver is not None:
            _unwind_on_sigterm()

    @property
    def extra(self) -> Any:
        """The ``extra`` of the checkpoint resumed from (None on a fresh start)."""
        return self.restored.extra if self.restored is not None else None

    def _due(self, step: int) -> bool:
        if self._every is None:
            return False
        kind, n = self._every
        if kind == "steps":
            return step - self._last_step >= n
        due = time.monotonic() - self._last_time >= n
        return bool(api._agree(due, self._size))

    def step(self, step: int, extra: object = None, force: bool = False) -> bool:
        """Call after optimizer step ``step`` (counting from 1): saves if due (or ``force``);
        returns whether it saved. Raises an earlier background save's failure."""
        if self._saver is None:
            return False
        self._saver.check()
        if not force and not self._due(step):
            return False
        model, optimizer, sampler = self._objects
        self._saver.save(step, model=model, optimizer=optimizer, sampler=sampler, extra=extra)
        self._last_step, self._last_time = step, time.monotonic()
        return True

    def close(self) -> None:
        """Wait for the last save and stop the writer."""
        if self._saver is not None:
            self._saver.close()

    def __enter__(self) -> Durable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unwind_on_sigterm() -> None:
    """SIGTERM raises ``SystemExit(143)`` from now on, where Python's default would end the
    process at once (a handler the script set is left alone; only the main thread may set one)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _preempted)


def _preempted(signum: int, _frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise SystemExit(128 + signum)


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
