"""How a rank's end is worded, and the job's failure report: pure, from the agents' messages.

An agent reports each rank's exit with its code, the signal that killed it, or, for a rank
that stopped sending heartbeats, how long it was silent before the agent killed it
(:func:`how_it_ended`). The first failure the supervisor acts on is kept as a
:class:`Failure`; :func:`report` is the launcher's last message, naming the rank, its host, how
it ended and the last lines of its error output. The launcher exits with ``Failure.code``
(128 + the signal number for a signal, as a shell does).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any


@dataclass
class Failure:
    rank: int | None
    host: str
    code: int
    description: str
    tail: list[str]


def how_it_ended(msg: dict[str, Any]) -> tuple[str, int]:
    """``(words, exit code)`` for an agent's ``exit`` message of a rank that did not succeed."""
    code, sig = msg.get("code"), msg.get("signal")
    if msg.get("silent_s") is not None:
        how = f"stopped responding (no heartbeat for {msg['silent_s']:.1f} s) and was killed"
        return how, 128 + int(signal.SIGKILL)
    if sig is not None:
        signum = int(signal.Signals[sig])
        return f"was killed by {sig}", 128 + signum
    return f"exited with code {code}", int(code or 1)


def report(f: Failure) -> str:
    """The launcher's closing message for a failed job."""
    lines = [f"job failed: {f.description}"]
    if f.tail:
        who = f"rank {f.rank}" if f.rank is not None else f"host {f.host}"
        lines.append(f"last lines of {who}'s error output:")
        lines.extend(f"  | {t}" for t in f.tail)
    return "\n".join(lines)
