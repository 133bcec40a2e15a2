"""This rank's heartbeat: a byte to its agent every :data:`INTERVAL_S` (``ringtrain run`` only).

The agent that started the rank passes the write end of a pipe as ``RINGTRAIN_HEARTBEAT_FD``;
``ringtrain.init`` starts a daemon thread that writes to it. A rank that stops without dying
(SIGSTOP, stuck in a driver) stops beating, and its agent kills it once it has been silent for
``launch.agent.SILENT_S`` and is stopped, or does no work (:mod:`ringtrain.launch.agent`), so the
job handles it like a dead rank.
The thread only writes to a pipe, never calls into torch, so it is safe at interpreter exit;
at exit the rank says goodbye, since the thread stops before the process ends. A main thread
holding the GIL in C silences the beats too; the agent tells that from a stop by the CPU time
the rank still uses.

More words travel on the same pipe, each when it happens: :data:`FAILING` (an uncaught
exception, said before the traceback is printed; :data:`FAILING_AFTER_PEER` for one that only
says a peer left first), :data:`LEAVING` (shutdown begins) and :data:`PREEMPTED` (a durable job
stops on a preemption, its step saved: :mod:`ringtrain.checkpoint.preemption`). The
agent stamps them with its clock, so the launcher can name the rank that failed *first*
(its peers fail after it, when they hear), and it lets a failing rank end by itself, with
its own exit code, instead of stopping it with the others.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Mapping

from ringtrain import environ
from ringtrain.environ import Ringtrain

VAR = Ringtrain.HEARTBEAT_FD
INTERVAL_S = 0.5
BEAT, GOODBYE = b".", b"!"  # GOODBYE: the process is exiting (its daemon threads stop soon)
FAILING, LEAVING = b"F", b"L"  # an uncaught exception; shutdown begins
FAILING_AFTER_PEER = b"P"  # an uncaught exception that says a peer left first: not a cause
PREEMPTED = b"S"  # stops on a SIGTERM, its step saved: ends by itself with 143, not a failure
_started: set[int] = set()


def say(word: bytes) -> None:
    """Tell the agent ``word`` (:data:`FAILING`, :data:`LEAVING`, ...) now; nothing without
    one."""
    for fd in _started:
        with contextlib.suppress(OSError):
            os.write(fd, word)


def preempted_at(step: int, world: int) -> bytes:
    """:data:`PREEMPTED` with the step saved and the (elastic) world's generation: the launcher
    groups the ranks that stopped at the same step of one world as one stop, though it hears of
    them one by one (launch/failures.py); a world re-formed from an earlier commit may reach
    the same step number again."""
    return PREEMPTED + b"%d/%d;" % (step, world)


def start(env: Mapping[str, str] | None = None) -> bool:
    """Start beating on the agent's pipe, once per process; False when there is none."""
    raw = (environ.current() if env is None else env).get(VAR, "").strip()
    if not raw:
        return False
    fd = int(raw)
    if fd in _started:
        return True
    _started.add(fd)

    def beat() -> None:
        with contextlib.suppress(OSError):  # the agent is gone: nobody listens any more
            while True:
                os.write(fd, BEAT)
                time.sleep(INTERVAL_S)

    def goodbye() -> None:
        with contextlib.suppress(OSError):
            os.write(fd, GOODBYE)

    threading.Thread(target=beat, name="ringtrain-heartbeat", daemon=True).start()
    # Interpreter finalization stops daemon threads while the process may take seconds more
    # to exit: the agent stops watching a rank that said goodbye.
    atexit.register(goodbye)
    return True
