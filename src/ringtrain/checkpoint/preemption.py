"""A durable job's preemption: SIGTERM stops every rank at one step, and that step is saved.

Kubernetes, Slurm and ``ringtrain run`` (forwarding its own) send SIGTERM to every rank, but no
two ranks take it at the same statement. A rank that unwound at once could leave in the tail of a
step whose save its peers then handed over: it never wrote its part, so that save could not
commit, and the job resumed from the one before, a whole interval's work lost (more where saves
are hours apart). So, in a job that saves (``Durable``, where the script left SIGTERM to Python's
default), the first SIGTERM is only noted; at the next ``Durable.step`` every rank learns that a
rank was signalled (the step's agreement, one small allreduce), saves that step and stops with
``SystemExit(143)``; the ``with`` block then waits for the save to commit. In an elastic job only
the signalled ranks stop, after the save, and the others go on in a smaller world.

A rank that reaches no step within half the grace period (``grace_period_s``: a step longer than
that, a loop waiting for input) unwinds there, as on Ctrl-C (the save in flight still commits,
a newer step is not saved). A second SIGTERM does that at once; a third ends the process.

A second SIGTERM that comes within ``duplicate_s()`` of the first is the same notice, not a
second one: Slurm signals every process of a cancelled or preempted job (the ranks, and the
launcher that started them in the batch script or under srun), and ``ringtrain run`` and
torchrun pass their own on at once, mpirun its sigkill timeout later (measured: test_preemption). Taken as a second notice,
it unwound every rank before the step's save (no checkpoint at all).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

from ringtrain import environ
from ringtrain.environ import OpenMPI, Torch
from ringtrain.runtime import departures, heartbeat, membership

EXIT_CODE = 128 + signal.SIGTERM
# torchrun's time from passing a SIGTERM on to its SIGKILL (torch.distributed.elastic's
# shutdown timeout, which no flag or variable sets).
TORCHRUN_KILL_S = 30.0
# A launcher's passing on of a SIGTERM that reached it and its ranks at once (Slurm): within
# milliseconds (ringtrain run, torchrun); this allows for a loaded host.
DUPLICATE_S = 2.0
log = logging.getLogger("ringtrain")


class Preemption:
    """The SIGTERM handling of one durable job (see the module docstring). States: open (steps
    will come: the first SIGTERM asks to stop at the next), closing (stopping, or waiting for
    the last save: the first SIGTERM is only noted, the wait goes on) and closed (nothing left
    to wait for: a SIGTERM unwinds at once)."""

    def __init__(self, within_s: float, loud: bool = True) -> None:
        self.within_s = within_s  # after the first SIGTERM, how long stopping may take
        self._level = logging.WARNING if loud else logging.INFO  # one rank says it, not each
        self.noted_at: float | None = None  # time.monotonic() of the first SIGTERM
        self.installed = False
        self._state = "open"
        self._timer: threading.Timer | None = None
        self._duplicate_s = duplicate_s()
        self._expired = False  # the time to reach a step is over: the timer's SIGTERM unwinds

    @property
    def requested(self) -> bool:
        return self.noted_at is not None

    def install(self) -> None:
        """Take SIGTERM where the script left Python's default, which ends the process at once
        (a handler the script set is left alone; only the main thread may set one)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _unwind_now):
            signal.signal(signal.SIGTERM, self._first)
            self.installed = True

    def _first(self, signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, self._again)  # the next one unwinds, unless a duplicate
        if self._state == "closed" or (self._state == "open" and self.within_s <= 0):
            self._unwind(signum, frame)  # no step to stop at, nothing to wait for: as Ctrl-C
        if self.requested:  # a second one (a section handed both to this handler)
            self._again(signum, frame)
            return
        self.noted_at = time.monotonic()
        if self._state == "closing":
            return  # the job stops already, its save waited for; close() raises after it
        log.log(
            self._level,
            "ringtrain: SIGTERM: the ranks stop at a step they agree on and save it (this rank "
            "unwinds where it is if that takes over %g s; a second SIGTERM over %g s later "
            "unwinds it now)",
            self.within_s,
            self._duplicate_s,
        )
        # pthread_kill: the main thread's blocking call (a sleep, a read) returns to run the
        # handler; a signal to the process may be taken by another thread, which wakes nothing.
        main = threading.main_thread().ident
        assert main is not None
        self._timer = threading.Timer(self.within_s, self._expire, (main, signum))
        self._timer.name = "ringtrain-preemption"
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, main: int, signum: int) -> None:
        self._expired = True
        signal.pthread_kill(main, signum)

    def _again(self, signum: int, frame: FrameType | None) -> None:
        """A SIGTERM after the first: the timer's, or a second notice, unwinds; the first one's
        duplicate (see the module docstring) is only noted."""
        since_s = time.monotonic() - (self.noted_at or 0.0)
        if self._expired or self.noted_at is None or since_s > self._duplicate_s:
            self._unwind(signum, frame)
        log.info(
            "ringtrain: a second SIGTERM %.2f s after the first: the same notice (a launcher "
            "passing on what reached its ranks too), not a second one",
            since_s,
        )

    def _unwind(self, signum: int, _frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the next one ends the process at once
        self._cancel()
        raise SystemExit(128 + signum)

    def stop(self, step: int) -> None:
        """Raise the ``SystemExit`` the job stops with (``step`` saved: its save handed over,
        or committed). Under ``ringtrain run`` the rank's agent hears of it first: the launcher
        reports a preemption, not a failure, and leaves the rank to end by itself. The peers
        read it too (an elastic job's, which go on, name it when their collectives break)."""
        self.closing()
        said(step)
        raise SystemExit(EXIT_CODE)

    def closing(self) -> None:
        """No step will come; the last save is being waited for."""
        self._state = "closing"
        self._cancel()

    def closed(self) -> None:
        """Nothing left to wait for: a SIGTERM from now on unwinds at once (also once a later
        durable job, which takes SIGTERM over, has closed in turn)."""
        self._state = "closed"
        self._cancel()
        main = threading.current_thread() is threading.main_thread()  # which alone may set it
        if (
            main
            and self.installed
            and signal.getsignal(signal.SIGTERM) in (self._first, self._again, self._unwind)
        ):
            signal.signal(signal.SIGTERM, _unwind_now)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _unwind_now(signum: int, _frame: FrameType | None) -> None:
    """SIGTERM once a durable job closed: unwind (the next one ends the process at once)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise SystemExit(128 + signum)


def duplicate_s() -> float:
    """How long after a rank's first SIGTERM a second is taken as the same notice:
    ``DUPLICATE_S``, and under mpirun also the time it passes a SIGTERM on after its own."""
    fixed = launcher_grace_s()
    return DUPLICATE_S + (fixed[1] if fixed is not None and fixed[0] == "mpirun" else 0.0)


def launcher_grace_s() -> tuple[str, float] | None:
    """Where the rank's launcher SIGKILLs it a fixed time after passing a SIGTERM on: the
    launcher and the seconds the rank has. Open MPI's mpirun: ``odls_base_sigkill_timeout``, 1
    by default (it passes the SIGTERM on that long after its own, and SIGKILLs that long after
    it); torchrun: TORCHRUN_KILL_S (it passes the SIGTERM on at once). None elsewhere (ringtrain
    run, srun, a pod's command: the grace period is theirs). Measured in
    tests/checkpoint/test_preemption.py."""
    env = environ.current()
    if OpenMPI.SIZE in env:
        return "mpirun", float(env.get(OpenMPI.SIGKILL_TIMEOUT) or 1)
    if Torch.TORCHELASTIC_RUN_ID in env:
        return "torchrun", TORCHRUN_KILL_S
    return None


def said(step: int) -> None:
    """Tell the rank's agent and its peers that it stops on a preemption, ``step`` saved."""
    departures.post(departures.PREEMPTED, str(step))
    heartbeat.say(heartbeat.preempted_at(step, membership.current()))
