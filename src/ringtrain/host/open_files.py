"""The open-file limit (``RLIMIT_NOFILE``) a rank needs, raised toward the hard limit.

A rank's sockets grow with the ranks it talks to (:mod:`ringtrain.host.connections`): at 1,024
ranks a job on the defaults holds about two thousand, more than the soft limit most systems
give a process (1,024), and a rank past it fails at its next connection with "Too many open
files". The soft limit may be raised by the process itself up to the hard limit, so the agent
that starts a host's ranks (:mod:`ringtrain.launch.agent`) raises its own before it starts them
(they inherit it), to what the job may need: every traffic of the model's table, whose groups
then connect every pair (:func:`~ringtrain.host.connections.most_files`), plus
:data:`HEADROOM` for the program itself. A hard limit below that cannot be raised from here; the
agent says so, and what to change.

:func:`plan` decides from numbers alone; :func:`raise_for` reads and sets the limit through
functions it is given (tests pass fakes). Plain Python: no torch.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from dataclasses import dataclass

from ringtrain.host import connections

# Files a rank holds besides ringtrain's connections: the interpreter, torch's libraries and
# the launcher's pipes (about 30, measured at 4 ranks by tests/runtime/test_sockets.py, which
# holds them to this), and what a program opens itself: its data loaders, checkpoints, logs.
BASE_FILES = 64
HEADROOM = 512
UNLIMITED = resource.RLIM_INFINITY


def needed(size: int) -> int:
    """Descriptors one rank of a job of ``size`` ranks may need, with room for the program."""
    return connections.most_files(size) + HEADROOM


def least(size: int) -> int:
    """Descriptors without which a rank of a job of ``size`` ranks may run out on its own."""
    return connections.most_files(size) + BASE_FILES


@dataclass(frozen=True)
class Plan:
    """What to do with the limit: ``soft`` becomes ``new_soft`` (the same: nothing to do)."""

    size: int
    need: int
    soft: int
    hard: int
    new_soft: int

    @property
    def raised(self) -> bool:
        return self.new_soft != self.soft

    @property
    def short(self) -> bool:
        """The hard limit leaves ringtrain's connections no room: only an administrator can
        raise it. (Between that and the need, the ranks get the hard limit, said as raised.)"""
        return self.hard != UNLIMITED and self.hard < least(self.size)


def _at_least(limit: int, need: int) -> bool:
    return limit == UNLIMITED or limit >= need


def plan(size: int, soft: int, hard: int) -> Plan:
    """The soft limit for ranks of a job of ``size``: raised to the need (at most the hard
    limit) where it is below, else left alone."""
    if size < 1:
        raise ValueError(f"a job has at least 1 rank, got {size}")
    need = needed(size)
    if _at_least(soft, need):
        return Plan(size, need, soft, hard, soft)
    return Plan(size, need, soft, hard, need if _at_least(hard, need) else hard)


def message(p: Plan) -> str | None:
    """The one line the agent logs: what it raised, or why the hard limit falls short."""
    why = (
        f"{p.size} ranks may hold up to {p.need} files each (sockets computed by "
        f"ringtrain.host.connections, plus {HEADROOM} for the program)"
    )
    if p.short:
        return (
            f"the open-file limit (RLIMIT_NOFILE) is too low: {why}, but the hard limit is "
            f"{p.hard}; the ranks start with {p.new_soft}, and one that runs out fails with "
            f"'Too many open files'.\nHINT: raise the hard limit to {p.need} or more: `ulimit "
            f"-Hn {p.need}` (as root) in the shell that starts the agents, a `* hard nofile "
            f"{p.need}` line in /etc/security/limits.conf (new logins take it), LimitNOFILE= "
            f"in a systemd unit, or the container's setting (docker run --ulimit nofile="
            f"{p.need}:{p.need}; Kubernetes: the container runtime's default)."
        )
    if p.raised:
        return f"raised the open-file limit (RLIMIT_NOFILE) from {p.soft} to {p.new_soft}: {why}"
    return None


Get = Callable[[int], tuple[int, int]]
Set = Callable[[int, tuple[int, int]], None]


def raise_for(
    size: int, get: Get = resource.getrlimit, set_: Set = resource.setrlimit
) -> str | None:
    """Raise this process's soft open-file limit for ranks of a job of ``size`` (children
    started afterwards inherit it); returns the line to log, or None when nothing was needed."""
    soft, hard = get(resource.RLIMIT_NOFILE)
    p = plan(size, soft, hard)
    if p.raised:
        set_(resource.RLIMIT_NOFILE, (p.new_soft, hard))
    return message(p)
