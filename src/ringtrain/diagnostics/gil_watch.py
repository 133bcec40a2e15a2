"""Where a rank is when no Python runs in it: faulthandler's watchdog, re-armed by a thread.

A rank whose main thread holds the GIL inside C code (an extension's long call, a C library
that waits without releasing it) runs no Python at all: its controller takes part in no round,
so every peer's collective waits, and neither the stall inspector nor the rank's own whereabouts
(:mod:`ringtrain.diagnostics.whereabouts`) can say anything. Only C code runs there, so C code
must speak: :func:`faulthandler.dump_traceback_later` starts a watchdog thread of its own that
prints every thread's Python stack on stderr once its timeout passes, without taking the GIL. A
thread of ours re-arms it every quarter of the timeout; a process whose Python runs keeps it
from ever firing, and one that holds the GIL longer than the timeout prints where it is
("Timeout (0:01:00)!" and the stacks, prefixed ``[r]`` under ``ringtrain run``). Once Python
runs again the thread says how long none ran, so the stacks above are explained.

Two cautions from CPython's implementation: there is one such watchdog per process (a script
that arms its own loses it to this one while the job is up), and a forked child that exits
normally while one is armed hangs at its exit (the child waits for the parent's watchdog
thread, which it does not have). So the watchdog is cancelled around every ``os.fork()`` (the
parent re-arms it after), and the timeout is the stall warning time, 0 turning both off (under
``ringtrain run``, at most its frozen-after time: :func:`timeout_for`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from ringtrain.config import Config

log = logging.getLogger("ringtrain")

REARMS_PER_TIMEOUT = 4
_lock = threading.Lock()
_watch: _Watch | None = None
_fork_hooks = False


# (process set id, when its control round in progress began, perf_counter) for each set of
# which this rank is rank 0 and that is in a round now.
Rounds = Callable[[], list[tuple[int, float]]]


class _Watch:
    def __init__(self, timeout_s: float, rank: int, rounds: Rounds) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.rounds = rounds
        self.told: dict[int, float] = {}  # set id -> the round whose wait was said
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ringtrain-gil-watch", daemon=True)

    def arm(self) -> None:
        faulthandler.dump_traceback_later(self.timeout_s, exit=False, file=_stderr())

    def _run(self) -> None:
        every = self.timeout_s / REARMS_PER_TIMEOUT
        last = time.monotonic()
        while not self.stop.wait(every):
            now = time.monotonic()
            with _lock:  # not while start(), stop() or a fork's hooks change the watchdog
                if self.stop.is_set():
                    return
                self.arm()
            if now - last > self.timeout_s:  # the watchdog armed at `last` has fired
                log.warning(
                    "ringtrain: rank %d: no Python ran in this process for at least %.1f s: a "
                    "call into C code held the GIL (or the process was stopped), so this rank "
                    "took part in no collective meanwhile. The stacks faulthandler printed "
                    "above after 'Timeout (...)!', %g s into it, show where its threads were.",
                    self.rank,
                    now - last - every,  # this thread's wait ended then, and it got no GIL
                    self.timeout_s,
                )
            last = now
            self._look_at_rounds()

    def _look_at_rounds(self) -> None:
        """The peers' side: a round that waits this long waits for a rank that runs no
        Python (its stacks come from its own watch). Said once per round, by the set's rank 0."""
        try:
            rounds = self.rounds()
        except Exception:  # the runtime shutting down under this thread: nothing to say
            return
        for set_id, since in rounds:
            waited = time.perf_counter() - since
            if waited > self.timeout_s and self.told.get(set_id) != since:
                self.told[set_id] = since
                log.warning(
                    "ringtrain: rank %d: process set %d's control round has waited %.0f s for "
                    "its peers (a round takes milliseconds): a rank that runs no Python (a call "
                    "into C code holding the GIL, a stopped process) holds every collective of "
                    "the set. That rank prints its threads' stacks on its own output "
                    "('Timeout (...)!', from faulthandler).",
                    self.rank,
                    set_id,
                    waited,
                )


def timeout_for(config: Config, beating: bool) -> float:
    """The stall warning time (0: off); under ``ringtrain run`` (``beating``: the rank beats
    to its agent) at most ``frozen_after_s``, so that a rank asleep holding the GIL, which its
    agent ends as frozen a few seconds past that, says where it was first."""
    if config.stall_warning_s <= 0 or not beating:
        return config.stall_warning_s
    return min(config.stall_warning_s, config.frozen_after_s)


def start(timeout_s: float, rank: int, rounds: Rounds = list) -> None:
    """Watch this process from now on (again after an elastic re-forming: the newest rank and
    timeout win), and the control rounds ``rounds`` lists; ``timeout_s`` 0 watches nothing."""
    global _watch, _fork_hooks
    stop()
    if timeout_s <= 0:
        return
    with _lock:
        if not _fork_hooks:
            os.register_at_fork(
                before=_before_fork, after_in_parent=_after_fork, after_in_child=_in_child
            )
            _fork_hooks = True
        _watch = _Watch(timeout_s, rank, rounds)
        _watch.arm()
        _watch.thread.start()


def stop() -> None:
    """Stop watching (``shutdown()``); the watchdog never fires after this returns."""
    global _watch
    with _lock:
        watch, _watch = _watch, None
        if watch is None:
            return
        watch.stop.set()
        faulthandler.cancel_dump_traceback_later()
    if watch.thread is not threading.current_thread():
        watch.thread.join()


def active() -> bool:
    return _watch is not None


def _before_fork() -> None:
    _lock.acquire()  # held across the fork: the watch thread cannot re-arm in between
    if _watch is not None:
        faulthandler.cancel_dump_traceback_later()


def _after_fork() -> None:
    try:
        if _watch is not None:
            _watch.arm()
    finally:
        _lock.release()


def _in_child() -> None:
    global _watch, _lock
    _watch = None  # its thread stayed in the parent
    _lock = threading.Lock()  # the parent's holds it: the child starts with its own


def _stderr() -> IO[str] | int:
    """stderr where it is a file with a descriptor, else descriptor 2 (a test's capture)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return 2
