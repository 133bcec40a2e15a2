"""Ctrl-C and SIGTERM wait for a save's bookkeeping: a save is handed over and recorded as one.

A Python signal handler runs between any two bytecodes of the main thread. Where it raises
(Ctrl-C's ``KeyboardInterrupt``, a durable job's ``SystemExit`` on SIGTERM), it could land
between the hand-over of a save to its writer and the record that the save is in flight: the
writer then wrote the save, but ``close()`` did not wait for it, and stopped the writer, which a
busy host had not scheduled in time (CI saw it: a preempted job lost the save it had started).
The same between taking a writer's outcome and recording it: the outcome was lost, and the
next wait waited for it in vain, until the launcher's grace period killed the rank.

Blocking the signals (``pthread_sigmask``) cannot help: another of the rank's threads takes the
signal, and the handler still runs in the main thread. So :func:`deferred` swaps each Python
handler of SIGINT and SIGTERM for one that only notes the signal, for the few statements of
the section, and calls the script's own handler after it: the interruption comes, only a few
statements later. Signals left to the system (``SIG_DFL``: the process ends at once) or ignored
are not touched, nor are handlers outside the main thread, the only one they run in.

A section may also wait (``Checkpointer.save`` waits for the previous save): with ``insist``, a
second signal of one kind is not deferred (the user insists): the first one's handler runs at
once, and where that handler left the signal to the system, the second one then takes that
effect; where it set another handler for the next one (Durable's: the next SIGTERM unwinds),
that one is deferred in turn.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)

Handler = Callable[[int, FrameType | None], Any]


@contextlib.contextmanager
def deferred(insist: bool = False) -> Iterator[None]:
    """Run the ``with`` block without being interrupted by a Python handler of SIGINT or
    SIGTERM; a signal that came meanwhile is handled when the block ends (its handler's
    exception is raised there, after the block's work). ``insist``: a second signal of one kind
    is handled at once (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers run only in the main thread: nothing here is interrupted by them
        return
    came: list[tuple[int, FrameType | None]] = []
    swapped: dict[int, Handler] = {}

    def note(signum: int, frame: FrameType | None) -> None:
        if insist and any(s == signum for s, _ in came):  # a second one: the user insists
            came[:] = [(s, f) for s, f in came if s != signum]
            try:
                swapped[signum](signum, frame)  # the first one's handling, now
            finally:
                after = signal.getsignal(signum)
                if after is signal.SIG_DFL:  # as the handler left the next one (the process
                    signal.raise_signal(signum)  # ends at once)
                elif callable(after) and after is not note:  # it chose the next one's handler
                    swapped[signum] = after  # (Durable's: unwind): that one waits here too
                    signal.signal(signum, note)
            return
        came.append((signum, frame))

    try:
        for sig in SIGNALS:
            handler = signal.getsignal(sig)
            if callable(handler):  # a Python handler: SIG_DFL and SIG_IGN are the system's
                swapped[sig] = handler
                signal.signal(sig, note)
        yield
    finally:
        for signum, handler in swapped.items():
            # Unless a handler run meanwhile left the signal to the system (SIG_DFL).
            if signal.getsignal(signum) is note:
                signal.signal(signum, handler)
        # As the first one's handler would have, a moment later (and if the block raised, with
        # its error as the context: the interruption is what ends the script).
        for signum, frame in came[:1]:
            swapped[signum](signum, frame)
