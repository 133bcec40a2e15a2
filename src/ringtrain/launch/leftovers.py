"""What a rank leaves behind when it exits: its children, found and ended by the agent.

A rank runs in its own session (the agent starts it with ``start_new_session``), so the
processes it starts (a ``sleep``, a DataLoader worker, a shell pipeline) share its session
unless they start one of their own. When a rank's process exits, its children are reparented:
to init by default, where nobody would ever end them. Two things make them findable:

- the agent is a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``): orphans of its ranks,
  even those that started a session of their own, become the agent's children, not init's;
- the agent notices a rank's exit *before* it reaps it (``waitid`` with ``WNOWAIT``): the rank's
  zombie still holds its pid, so the session that pid names is the rank's, never a later
  process's with a reused pid, and :func:`end_session` signals exactly what is left in it.

When no rank of the agent is left, every process still below the agent is a leftover of the
job, and :func:`sweep` ends them (SIGTERM, SIGKILL after the grace period) and reaps them.
Nothing outside the agent's own descendants (or its ranks' sessions) is ever signalled.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Collection

import psutil

_PR_SET_CHILD_SUBREAPER = 36

# Whether everything below this process is the job's: only in an agent's own process
# (``python -m ringtrain.launch.agent``, whose main() says so). An Agent object inside another
# process (a test's) must never end or reap that process's other children.
_owns_descendants = False


def become_subreaper() -> bool:
    """Make orphans of this process's descendants its children (Linux; False elsewhere), and
    let :func:`sweep` and :func:`reap_orphans` act: called by the agent's own process only."""
    global _owns_descendants
    _owns_descendants = True
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def has_exited(pid: int) -> bool:
    """Whether child ``pid`` has ended, without reaping it (its pid stays held); False if the
    platform cannot tell without reaping (the caller's ``poll`` then does both)."""
    waitid = getattr(os, "waitid", None)
    if waitid is None:
        return False
    try:
        return waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # already reaped
    except OSError:
        return False


def end_session(leader: int, sig: signal.Signals = signal.SIGTERM) -> list[psutil.Process]:
    """Signal what is left of the session (and process group) of ``leader``, an exited rank
    whose zombie is not reaped yet; returns the processes signalled."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, sig)  # the group at once, before any of it can fork again
    hit = []
    for p in psutil.process_iter():
        if p.pid == leader:
            continue
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(p.pid) == leader:
                p.send_signal(sig)
                hit.append(p)
    return hit


def below(root: int, ranks: Collection[int]) -> list[psutil.Process]:
    """Every descendant of ``root`` outside the live ``ranks``' own trees."""
    try:
        everything = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    skip: set[int] = set()
    for p in everything:
        if p.pid in ranks:
            skip.add(p.pid)
            with contextlib.suppress(psutil.Error):
                skip.update(c.pid for c in p.children(recursive=True))
    return [p for p in everything if p.pid not in skip]


def reap(procs: Collection[psutil.Process]) -> None:
    """Collect the exit of those of ``procs`` that are this process's children and ended."""
    me = os.getpid()
    for p in procs:
        with contextlib.suppress(OSError, psutil.Error):
            if p.ppid() == me:
                os.waitpid(p.pid, os.WNOHANG)


def reap_orphans(ranks: Collection[int]) -> None:
    """Collect the orphans that became this process's children and have ended since (a rank's
    short-lived daemon), so that no zombie piles up while the job runs."""
    if not _owns_descendants:
        return
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for p in children:
        with contextlib.suppress(OSError, psutil.Error):
            if p.pid not in ranks and p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)


def sweep(grace_s: float, ranks: Collection[int] = ()) -> int:
    """End every process below this one but the live ``ranks``: SIGTERM, SIGKILL what is left
    after ``grace_s``; returns how many there were."""
    left = below(os.getpid(), ranks) if _owns_descendants else []
    if not left:
        return 0
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        reap(left)
        if not any(_alive(p) for p in left):
            break
        time.sleep(0.05)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(psutil.Error):
        psutil.wait_procs(left, timeout=1.0)  # reaps this process's children among them
    return len(left)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
