"""One host's agent as the launcher sees it: the process, its message reader, its last words.

An :class:`AgentLink` starts the agent (a local subprocess or ssh, argv from
:mod:`ringtrain.launch.agent_start`), turns each JSON line it prints into an event on the
supervisor's queue, keeps the last lines of its error output (ssh's own reason when a host cannot
be reached), and sends it commands. :func:`unreachable` words the error for agents that never
answered.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import subprocess
import threading
import time
from typing import Any

from ringtrain.launch import protocol
from ringtrain.launch.hosts import Host

AGENT_ERR_LINES = 20
# How long a finished job's agents get to exit on their closed input (a Python interpreter's
# exit, and ssh's on a remote host) before the launcher kills what is left.
AGENT_EXIT_S = 10.0


class AgentLink:
    """One host's agent process (local or ssh) and the thread that reads its messages."""

    def __init__(self, index: int, host: Host, argv: list[str], events: queue.Queue[Any]) -> None:
        self.index = index
        self.host = host
        self.argv = argv
        self.hello: dict[str, Any] | None = None
        self.done = False
        self.lost = False
        self.ranks: list[int] = []  # identities of the ranks this agent runs
        self.joining = False  # started for a running elastic job; its ranks join when ready
        self.err_tail: collections.deque[str] = collections.deque(maxlen=AGENT_ERR_LINES)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            start_new_session=True,  # Ctrl-C goes to the launcher, which forwards it on purpose
        )
        self._events = events
        self._err_reader = threading.Thread(target=self._read_err, daemon=True)
        self._err_reader.start()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:  # closed at its end, not left to the interpreter's exit
            for line in self.proc.stdout:
                msg = protocol.parse(line)
                if msg is not None:
                    # Here, not where the supervisor handles it (which may be busy starting the
                    # job): the time a rank's line reached the launcher, for its timestamp.
                    msg["received_at"] = time.time()
                    self._events.put((self, msg))
        self.proc.wait()
        # The eof report quotes err_tail (ssh's own words), so wait for stderr to drain too; a
        # grandchild holding stderr open must not hold the report up for long.
        self._err_reader.join(timeout=2.0)
        self._events.put((self, {"t": "eof"}))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self.err_tail.append(line.rstrip("\n"))

    def send(self, kind: str, **fields: Any) -> None:
        if self.proc.stdin is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            protocol.send(self.proc.stdin, kind, **fields)

    def close_input(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()

    def end(self, until: float) -> None:
        """Wait until the ``time.monotonic()`` deadline ``until`` for the agent to exit (after
        :meth:`close_input`), then kill it if it has not."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.0, until - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


def unreachable(links: list[AgentLink], what: str) -> str:
    """The error for agents that did not start: each one's error output, then what to check."""
    lines = []
    for lk in links:
        detail = "\n    ".join(lk.err_tail) or "(no output)"
        lines.append(f"the agent on host {lk.host.name} {what}:\n    {detail}")
    hint = (
        "HINT: check `ssh HOST true` works without a password prompt (BatchMode), that the "
        "host key is known, and that ringtrain is installed at the same path on every host; "
        "`ringtrain doctor -H ...` checks all of this."
    )
    return "\n".join([*lines, hint])
