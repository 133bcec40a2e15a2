"""The messages between the launcher and a host's agent: one JSON object per line.

Launcher -> agent (agent's stdin):
    {"t": "start", "ranks": [RankLaunch...], "cwd": str, "key": hex | null, "grace_s": float,
     "frozen_s": float}                             frozen_s: the job's Config.frozen_after_s
    {"t": "signal", "sig": "SIGINT" | "SIGTERM"}   forward a signal to every rank
    {"t": "stop", "notice_s": float}                 end every rank (TERM, then KILL after grace),
                                                      after notice_s for those unaware (optional)
    {"t": "kill"}                                    SIGKILL every rank (a signal's grace is over)
    end of input                                     the launcher is gone: stop everything, exit

Agent -> launcher (agent's stdout):
    {"t": "hello", "facts": {...}, "interfaces": [...]}   first, before any start
    {"t": "started", "rank": r, "pid": p}
    {"t": "note", "line": str}                        a line for the user (a limit it raised)
    {"t": "out", "rank": r, "fd": 1 | 2, "line": str, "end": "\n" | "\r"}
    {"t": "stopping", "rank": r, "at": [step, world]}  the rank stops on a preemption, that step
                                                      of that (elastic) world saved: it exits soon
    {"t": "exit", "rank": r, "code": int | null, "signal": str | null, "tail": [str],
     "hint": [str], ...}                              killed: SIGKILLed on "kill"; hint:
                                                      what to do about it (exit_hints)
    {"t": "done"}                                     every rank has exited

The launcher's reader adds ``"received_at"`` (its own ``time.time()``) to each message it gets.
"""

from __future__ import annotations

import json
from typing import IO, Any

PROTOCOL_VERSION = 1


def send(stream: IO[str], kind: str, **fields: Any) -> None:
    stream.write(json.dumps({"t": kind, **fields}, separators=(",", ":")) + "\n")
    stream.flush()


def parse(line: str) -> dict[str, Any] | None:
    """A message, or None for a line that is not one (e.g. a login banner printed by the shell)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        msg = json.loads(line)
    except json.JSONDecodeError:
        return None
    return msg if isinstance(msg, dict) and "t" in msg else None
