"""Where a rank is while its peers wait for it: its own threads' Python stacks, said by itself.

The stall report (:mod:`ringtrain.diagnostics.stall`, logged by a process set's rank 0) names the
rank that has not submitted a collective, but not why: it may be in a data loader, a loop that
does not end, a branch that skipped the call, or another collective. Only that rank can tell.
Its controller keeps the same table of requests as rank 0's (every rank's requests reach every
rank), so it sees the same stall from its side: a name its peers submitted and it has not. It
then logs where its own threads are, at the cadence of rank 0's warnings (the stall warning
time), on its own output, where ``ringtrain run`` prefixes it with the rank.

What it cannot show: a rank whose main thread holds the GIL in C code (its controller cannot
run Python either, and the round that would tell rank 0 stalls too: there faulthandler's
watchdog speaks, :mod:`ringtrain.diagnostics.gil_watch`); a rank that is gone.

DistributedOptimizer's buckets are not negotiated, so there the ranks waiting in ``step()``
ask: the lowest of them, when it reports (:mod:`ringtrain.diagnostics.engine_wait`), leaves a
question in the job's store for each rank not waiting there, and that rank's :class:`Away`,
once it has been out of ``step()`` for half the warning time, finds it and answers alike.

:func:`stalled_here`, :func:`report` and :func:`step_report` are the pure parts, tested with
plain values; :func:`threads_now` reads this process's threads.
"""

from __future__ import annotations

import logging
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from ringtrain.diagnostics.stall import Waiting

log = logging.getLogger("ringtrain")

# Enough to show the caller's own frames under a deep library stack; a report per thread.
FRAMES_SHOWN = 10
# Library frames above the user's innermost one shown whole; more fold to the first and the
# last two.
LIBRARY_SHOWN = 4
THREADS_SHOWN = 6
# How often a controller looks for names its peers wait for (rank 0's inspector looks every round).
LOOK_EVERY_S = 1.0
# ringtrain's own threads (controllers, watches, writers) are never where a user's rank is.
OWN_THREADS = "ringtrain-"
_PACKAGE = str(Path(__file__).resolve().parents[1])  # src/ringtrain
_LIBRARIES = (
    _PACKAGE,
    *{sysconfig.get_path(p) for p in ("stdlib", "platstdlib", "purelib", "platlib")},
)


def stalled_here(
    waiting: Mapping[str, Waiting], me: int, for_s: float, now: float
) -> list[Waiting]:
    """The names that have waited at least ``for_s`` for this rank (``me``, a set rank) and
    that it has not submitted, oldest first."""
    late = [w for w in waiting.values() if now - w.since >= for_s and me not in w.submitted]
    return sorted(late, key=lambda w: w.since)


def report(
    world_rank: int,
    stalled: Sequence[Waiting],
    now: float,
    to_global: Sequence[int],
    threads: Sequence[tuple[str, list[str]]],
    set_id: int = 0,
    same_as_last: bool = False,
) -> str:
    """The warning of rank ``world_rank``: what its peers wait for, and ``threads``, each a
    thread's name and its formatted frames (:func:`threads_now`)."""
    where = f" on process set {set_id}" if set_id else ""
    shown = ", ".join(
        f"{w.name!r} ({now - w.since:.0f} s; submitted by ranks {_global(w.submitted, to_global)})"
        for w in stalled[:5]
    )
    more = f" and {len(stalled) - 5} more" if len(stalled) > 5 else ""
    head = f"rank {world_rank} keeps its peers waiting{where}: it has not submitted "
    if same_as_last:  # one line: the stacks and the hint are a warning time up the log
        return f"{head}{shown}{more}; its threads are still where its last report showed them."
    hint = (
        "a rank that never submits what its peers wait in: a branch taken on some ranks "
        "only, an uneven number of batches (see ringtrain.join()), a loop or a data loader that "
        "does not return, or another collective that its peers never call."
    )
    return _with_threads(f"{head}{shown}{more}.", threads, hint)


def step_report(
    world_rank: int,
    step: int,
    waiting: str,
    last_step: int,
    threads: Sequence[tuple[str, list[str]]],
) -> str:
    """The warning of rank ``world_rank``, outside ``step()`` (it last began ``last_step``),
    when ranks ``waiting`` (as they wrote it) wait in step ``step``."""
    head = (
        f"rank {world_rank} keeps its peers waiting in step(): ranks {waiting} wait there for the "
        f"gradients of step {step}, and this rank is not in step() (the last step it began: "
        f"{last_step})."
    )
    hint = (
        "a rank that stopped taking steps: its data ran out first (uneven batches), a loop or "
        "a data loader that does not return, or a collective that its peers do not call."
    )
    if last_step == 0:
        head = (
            f"rank {world_rank} keeps its peers waiting in step(): ranks {waiting} wait there "
            f"for the gradients of step {step}, and this rank has not begun a step yet."
        )
        hint = (
            "a rank that never reaches its first step: a data loader, a download or a file "
            "system that does not answer on this host, or a branch that its peers do not take."
        )
    return _with_threads(head, threads, hint)


def _with_threads(head: str, threads: Sequence[tuple[str, list[str]]], hint: str) -> str:
    lines = [head, "Where its threads are now (most recent call last):"]
    for name, frames in threads:
        lines.append(f"  thread {name}:")
        lines += frames
    lines.append(f"HINT: {hint}")
    return "\n".join(lines)


def _global(set_ranks: Sequence[int], to_global: Sequence[int]) -> list[int]:
    return [to_global[r] for r in set_ranks]


def threads_now(
    frames: Mapping[int, FrameType] | None = None,
    threads: Sequence[threading.Thread] | None = None,
    skip: int | None = None,
) -> list[tuple[str, list[str]]]:
    """This process's threads but ringtrain's own and ``skip`` (an ident: the caller's), the
    main thread first, each with its last :data:`FRAMES_SHOWN` frames of the user's own code.
    Frames inside ringtrain at the top of a stack (a collective the thread waits in) fold into
    one line; other library frames there into the first and the last ones."""
    frames = sys._current_frames() if frames is None else frames
    named = {t.ident: t for t in (threading.enumerate() if threads is None else threads)}
    out: list[tuple[bool, str, list[str]]] = []
    for ident, frame in frames.items():
        thread = named.get(ident)
        name = thread.name if thread is not None else f"{ident} (not started by Python)"
        if ident == skip or name.startswith(OWN_THREADS):
            continue
        main = thread is threading.main_thread()
        out.append((not main, name, _frames(frame)))
    out.sort(key=lambda t: t[0])
    return [(name, lines) for _, name, lines in out[:THREADS_SHOWN]]


def _frames(frame: FrameType) -> list[str]:
    """A thread's stack, innermost last: its last frames up to the innermost one of the user's
    own code, then the library calls it waits in, folded so that the user's frames show."""
    stack = traceback.extract_stack(frame)
    user = len(stack)  # past the innermost frame of the user's own code
    while user > 0 and _library(stack[user - 1].filename):
        user -= 1
    start = 0  # past the library frames that started the thread (threading's, runpy's)
    if user == 0:  # a thread that runs library code only
        user = len(stack)
    else:
        while _library(stack[start].filename):
            start += 1
    run = stack[user:]
    inside = [e for e in run if e.filename.startswith(_PACKAGE)]
    if inside:  # a collective the user's call waits in: one line
        first = inside[0]  # where the user's call entered ringtrain
        where = Path(first.filename).relative_to(_PACKAGE)
        tail = [f"      (inside ringtrain: {where}:{first.lineno}, in {first.name})"]
    elif len(run) > LIBRARY_SHOWN:  # where the call entered the libraries, and where it is
        folded = f"      ... {len(run) - 3} more frames in libraries ..."
        tail = [*_format(run[:1]), folded, *_format(run[-2:])]
    else:
        tail = _format(run)
    return _format(stack[max(user - FRAMES_SHOWN, start) : user]) + tail


def _format(entries: Sequence[traceback.FrameSummary]) -> list[str]:
    shown = traceback.format_list(list(entries))
    return ["  " + line for entry in shown for line in entry.rstrip("\n").splitlines()]


def _library(filename: str) -> bool:
    """Whether a frame is ringtrain's, Python's own or an installed package's."""
    return filename.startswith(_LIBRARIES)


class Member(Protocol):
    """This rank in a process set (a :class:`~ringtrain.runtime.communicator.Communicator`)."""

    @property
    def set_rank(self) -> int: ...
    @property
    def set_id(self) -> int: ...
    @property
    def ranks(self) -> Sequence[int]: ...


class Whereabouts:
    """One controller's side of the stall report: says where this rank is when its peers
    have waited for it for ``warning_s`` (0: never, as the stall inspector), then at most once
    per ``warning_s``. With a stall shutdown time, first at half of it if that is sooner: the
    job stops at the shutdown time, and the report is what tells why."""

    def __init__(
        self,
        member: Member,
        warning_s: float,
        shutdown_s: float = 0.0,
        threads: Callable[[], list[tuple[str, list[str]]]] | None = None,
    ) -> None:
        self._me = member.set_rank
        self._ranks = list(member.ranks)
        self._warning_s = warning_s
        self._first_s = min(warning_s, shutdown_s / 2) if shutdown_s > 0 else warning_s
        self._set_id = member.set_id
        # Read on the controller's thread, which is not where the user's code is: skipped.
        self._threads = threads or (lambda: threads_now(skip=threading.get_ident()))
        self._next = 0.0  # not before this time: one report per warning time
        self._last: list[tuple[str, list[str]]] | None = None

    def look(self, waiting: Callable[[float, float], Mapping[str, Waiting]], now: float) -> str:
        """Log (and return) where this rank is, if its peers have waited for it long enough;
        ``waiting(now, for_s)``: the names pending at least ``for_s`` (the request table's)."""
        if self._warning_s <= 0 or now < self._next:
            return ""
        stalled = stalled_here(waiting(now, self._first_s), self._me, self._first_s, now)
        if not stalled:
            self._next = now + min(LOOK_EVERY_S, self._first_s / 4)
            return ""
        self._next = now + self._warning_s
        threads = self._threads()
        same = threads == self._last
        self._last = threads
        said = report(self._ranks[self._me], stalled, now, self._ranks, threads, self._set_id, same)
        log.warning("%s", said)
        return said


class Away:
    """This rank's time outside one optimizer's ``step()`` waits, and its answer when ranks
    that wait in a step ask where it is (:mod:`ringtrain.diagnostics.engine_wait`'s report asks,
    under this rank's ``key``). A rank out of ``step()`` (since its last wait, or since the
    optimizer was built: the owner calls :meth:`ended` at its start) for half the warning time
    looks for the question every quarter of it, so a job whose steps take less asks nothing.
    The owner (a ``WaitWatch``) calls :meth:`began`, :meth:`ended` and :meth:`looking` under its
    lock, and :meth:`look` (store calls) on its own thread."""

    def __init__(
        self,
        store: Any,
        key: str,
        world_rank: int,
        warning_s: float,
        threads: Callable[[], list[tuple[str, list[str]]]] = threads_now,
    ) -> None:
        self._store = store
        self._key = key
        self._rank = world_rank
        self._warning_s = warning_s
        self._threads = threads  # the watch's own thread is ringtrain's: left out
        self.last_step = 0  # the last step this rank began
        self._left: float | None = None  # when its last wait ended; None: in one, or none yet
        self._next = 0.0

    def began(self, step: int) -> None:
        self.last_step, self._left = step, None

    def ended(self, now: float) -> None:
        self._left, self._next = now, now + self._warning_s / 2

    def due(self) -> float | None:
        """When to look next; None: not now (in a wait, or the inspector is off)."""
        return None if self._left is None or self._warning_s <= 0 else self._next

    def looking(self, now: float) -> None:
        self._next = now + self._warning_s / 4

    def look(self) -> str:
        """Log (and return) where this rank is, if ranks waiting in a step asked."""
        if not self._store.check([self._key]):
            return ""
        asked = bytes(self._store.get(self._key)).decode()
        self._store.delete_key(self._key)
        step, _, waiting = asked.partition(":")
        said = step_report(self._rank, int(step), waiting, self.last_step, self._threads())
        log.warning("%s", said)
        return said
