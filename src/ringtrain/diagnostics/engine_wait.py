"""Why ``step()`` waits: the ranks that are not waiting with this one, named.

DistributedOptimizer's bucket allreduces go straight to the transport (no controller, so no
stall inspector): when one rank stops taking steps, because its data ran out first (uneven
batches), it is stuck elsewhere, or it died without the launcher noticing, the other ranks wait
inside Gloo or NCCL until the transport's timeout, minutes later, with nothing said.

So ``synchronize()`` tells a :class:`WaitWatch` when it starts and stops waiting. A wait that
passes half the warning time is posted under the rank's key in the job's store ("waiting in
step k"); at the warning time the rank reads every member's post and logs one warning naming
the ranks that are elsewhere: waiting in another step (they ran a different number of steps),
finished (``ringtrain.shutdown()`` posts that), or not waiting at all (in forward, backward or
data loading, stuck, or gone). Only the lowest waiting rank logs, so the job prints one report;
when every rank waits in the same step the exchange itself is slow, and nothing is said.
Posts are taken back when the wait ends, and only a wait that lasted writes anything.

:func:`explain` is the pure part, tested with plain numbers.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ringtrain.diagnostics import stall, whereabouts
from ringtrain.errors import (
    UNEVEN_DATA,
    CollectiveUnsupportedError,
    RingtrainError,
    StallError,
)
from ringtrain.runtime import exit_guard

log = logging.getLogger("ringtrain")

FINISHED = "finished"
# A wait is posted after half the warning time, or this long if sooner: a peer in join() reads
# the posts to tell that it is left behind (left_behind), and should not wait a minute for it.
POST_AFTER_S = 5.0
# How often a rank in join() reads its peers' posts.
JOIN_LOOK_S = 0.5
# Past the stall shutdown time, how often a wait looks again for the members missing from it.
LOOK_AGAIN_S = 1.0

_LIVE: weakref.WeakSet[WaitWatch] = weakref.WeakSet()  # this process's watches (join() reads)


def finished_key(world_rank: int) -> str:
    return f"ringtrain/engine/finished/{world_rank}"


def explain(
    me: int,
    step: int,
    waited_s: float,
    states: Mapping[int, int | str | None],
    timeout_s: float,
    failed: bool = False,
    doing: Mapping[int, str] | None = None,
    shutdown_s: float = 0.0,
    stopped: bool = False,
    what: str = "",
) -> str:
    """The warning for rank ``me``, waiting ``waited_s`` in ``step`` (``failed``: the error of
    a wait that ran past the transport timeout; ``stopped``: the error of one ended at the stall
    shutdown time, ``shutdown_s``). ``states`` holds every member rank's post: a step number it
    waits in, :data:`FINISHED`, or None (no post). ``doing``: for ranks without a post, the
    collective they are known to wait in instead (the controllers' posts). ``what``: what the
    wait is for, if not step ``step``'s gradients (local updates' outer exchange)."""
    doing = doing or {}
    same = sorted(r for r, s in states.items() if s == step)
    other = {r: s for r, s in states.items() if isinstance(s, int) and s != step}
    done = sorted(r for r, s in states.items() if s == FINISHED)
    silent = sorted(r for r, s in states.items() if s is None and r != me and r not in doing)
    if stopped:
        waited = f"step() gave up after {waited_s:.0f} s, past the stall shutdown time,"
    elif failed:
        waited = (
            f"step() gave up after {waited_s:.0f} s, the transport timeout ({timeout_s:g} s, "
            "RINGTRAIN_TIMEOUT_S),"
        )
    else:
        waited = f"ringtrain: step() has waited {waited_s:.0f} s"
    lines = [f"{waited} for {what or f'the gradients of step {step}'}; ranks {same} wait there."]
    for r, s in sorted(other.items()):
        lines.append(
            f"  rank {r} waits in step {s}: it ran {abs(s - step)} step(s) "
            f"{'more' if s > step else 'fewer'} than these ranks"
        )
    if done:
        lines.append(f"  ranks {done} have finished (ringtrain.shutdown()): they ran fewer steps")
    for r, what in sorted(doing.items()):
        if states.get(r) is None and r != me:
            lines.append(
                f"  rank {r} waits in {what}, not in step(): the ranks run different "
                "collectives here (one that only some ranks call, such as a metric under "
                "`if rank == 0`)"
            )
    if silent:
        lines.append(
            f"  ranks {silent} are not waiting in step(): still in forward, backward or data "
            "loading, stuck elsewhere, or gone"
        )
    if failed or stopped:
        ends = ""
    elif 0 < shutdown_s < timeout_s:
        ends = (
            f" The wait fails at the stall shutdown time ({shutdown_s:g} s, "
            "--stall-shutdown-time) if these ranks stay away."
        )
    else:
        ends = f" The wait fails at the transport timeout ({timeout_s:g} s, RINGTRAIN_TIMEOUT_S)."
    lines.append(f"HINT: every rank must take the same number of steps; {UNEVEN_DATA}.{ends}")
    if stopped:
        lines.append(stall.stopping(shutdown_s))
    return "\n".join(lines)


class WaitWatch:
    """Watches one optimizer's waits in ``synchronize()`` on one rank."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        members: Sequence[int],
        warning_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        doing: Callable[[int], str] | None = None,
        shutdown_s: float = 0.0,
    ) -> None:
        """``doing(r)``: the collective rank r is known to wait in, or '' (read only for ranks
        that post no step). ``shutdown_s``: the stall shutdown time (0: never), past which a
        wait that some members never joined ends (:meth:`check`)."""
        self._store = store
        self._doing = doing
        self._prefix = prefix
        self._rank = rank
        self.members = list(members)
        self.warning_s = warning_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        # (step, since, what): what the wait is for, if not the step's gradients (explain)
        self._wait: tuple[int, float, str] | None = None
        self._posted = False  # this wait is posted
        self._warned = False  # this wait was reported
        self._unpost = False  # a post of an ended wait is still in the store
        self._closed = False
        self.shutdown_s = shutdown_s
        self._look_at = 0.0  # when to look for a stall next (with shutdown_s)
        self._missing: list[int] | None = None  # the members missing at the last look
        self._stall = ""  # the error that ends this wait: the stall shutdown time passed
        # Outside step(), from the start (a rank stuck before its first step is asked too):
        # the last step begun, and where this rank is if waiting ranks ask.
        self._away = whereabouts.Away(store, self._asked_key(rank), rank, warning_s)
        self._away.ended(clock())
        # Ends at close(), which the optimizer's finalizer calls (engine.parameters.make_watch).
        self._thread = threading.Thread(target=self._run, name="ringtrain-wait-watch", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    @property
    def last_step(self) -> int:
        """The last step this rank began."""
        return self._away.last_step

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/waiting/{rank}"

    def _asked_key(self, rank: int) -> str:
        return f"{self._prefix}/where/{rank}"

    def begin(self, step: int, what: str = "") -> None:
        with self._cond:
            self._wait = (step, self._clock(), what)
            self._away.began(step)
            self._posted = self._warned = False
            self._look_at = self._wait[1] + self.shutdown_s + self._post_s()
            self._missing, self._stall = None, ""
            self._cond.notify()

    def end(self) -> None:
        with self._cond:
            self._wait = None
            self._away.ended(self._clock())
            if self._posted:
                self._unpost = True
                self._posted = False
                self._cond.notify()

    def check(self) -> None:
        """Raise the :class:`~ringtrain.errors.StallError` that ends this wait, once the stall
        shutdown time has passed with members that never joined it (called between the slices
        of the wait, see :func:`ringtrain.runtime.abort.stopping`)."""
        with self._cond:
            stall = self._stall
        if stall:
            raise StallError(stall)

    def _post_s(self) -> float:
        return min(self.warning_s / 2, POST_AFTER_S)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def left_behind(self) -> str:
        """For a rank in join(): why a peer waits in vain, or ''. A peer that waits in a step
        this rank never began waits for gradients that will not come: join() contributes zeros
        to explicit allreduces only, not to step()'s exchange."""
        for r in self.members:
            state = self._state(r) if r != self._rank else None
            if isinstance(state, int) and state > self.last_step:
                return (
                    f"join() cannot stand in for DistributedOptimizer.step(): rank {r} waits in "
                    f"step() for the gradients of step {state}, and this rank joined after "
                    f"{self.last_step} step(s); it would wait until the transport timeout.\n"
                    f"HINT: every rank must take the same number of steps; {UNEVEN_DATA}."
                )
        return ""

    def failed(self, e: BaseException) -> BaseException:
        """The error to raise for this rank's wait that ended in ``e``: past the transport
        timeout, a :class:`~ringtrain.errors.StallError` naming where the other ranks are
        (Gloo's own says only that a receive timed out), else ``e``. Only a wait long enough
        to have been posted is explained: a peer's post is then there if it waits too."""
        with self._cond:
            wait, posted = self._wait, self._posted
        if wait is None or not posted or isinstance(e, RingtrainError):
            return e
        if "timed out" not in str(e).lower():
            return e
        step, since, what = wait
        try:
            states = {r: self._state(r) for r in self.members}
        except Exception:  # the store is gone too: Gloo's error is all there is
            return e
        waited = self._clock() - since
        doing = self._elsewhere(states)
        return StallError(
            explain(self._rank, step, waited, states, self._timeout_s, True, doing, what=what)
        )

    def _run(self) -> None:
        while True:
            with self._cond:
                action = self._next_action()
                if action is None:
                    return
            # Store calls, from a daemon thread: none may be under way while the interpreter
            # finalizes (see ringtrain.runtime.exit_guard), and none starts after that.
            with exit_guard.native_call() as ok:
                if not ok:
                    return
                try:
                    action()
                except Exception as e:  # a diagnostic must never fail training
                    log.debug("ringtrain wait watch: %s", e)

    def _next_action(self) -> Callable[[], object] | None:
        """Under the lock: sleep until there is something to do; None once closed."""
        while not self._closed:
            if self._unpost:
                self._unpost = False
                return lambda: self._store.delete_key(self._key(self._rank))
            looks = self.shutdown_s > 0 and not self._stall
            if self._wait is None:  # outside step(): have waiting ranks asked where it is?
                due, now = self._away.due(), self._clock()
                if due is not None and due <= now:
                    self._away.looking(now)
                    return self._away.look
                self._cond.wait(None if due is None else due - now)
                continue
            if self._warned and not looks:
                self._cond.wait()
                continue
            step, since, _ = self._wait
            dues = [since + (self.warning_s if self._posted else self._post_s())]
            dues = dues if not self._warned else []
            dues += [self._look_at] if looks and self._posted else []
            now = self._clock()
            if min(dues) > now:
                self._cond.wait(min(dues) - now)
                continue
            if not self._posted:
                self._posted = True
                return lambda: self._store.set(self._key(self._rank), str(step))
            if not self._warned and dues[0] <= now:
                self._warned = True
                return lambda: self._report(step, now - since)
            self._look_at = now + LOOK_AGAIN_S
            return lambda: self._look_for_stall(step, now - since)
        return None

    def _look_for_stall(self, step: int, waited: float) -> None:
        """Past the stall shutdown time (and the time a peer takes to post its own wait, so
        that every member waiting in this step has posted): the members not waiting here never
        joined it in time. Seen at two looks a second apart (a peer whose wait just ended took
        its post back, and this wait ends too), that ends the wait: :meth:`check`."""
        states = {r: self._state(r) for r in self.members}
        missing = sorted(r for r, s in states.items() if s != step)
        doing = self._elsewhere(states) if missing else {}
        with self._cond:
            if self._wait is None or self._wait[0] != step:
                return
            what = self._wait[2]
            if not missing:  # all here: a slow exchange, not a stall; looked at again later
                self._missing, self._look_at = None, self._clock() + self._post_s()
                return
            if missing != self._missing:
                self._missing = missing
                return
            self._stall = explain(
                self._rank, step, waited, states, self._timeout_s, False, doing,
                self.shutdown_s, stopped=True, what=what,
            )  # fmt: skip

    def _report(self, step: int, waited: float) -> None:
        states = {r: self._state(r) for r in self.members}
        waiting_here = [r for r, s in states.items() if s == step]
        if len(waiting_here) == len(states):
            return  # all wait in this step together: a slow exchange, not a rank elsewhere
        if waiting_here and min(waiting_here) != self._rank:
            return  # the lowest waiting rank speaks for all
        with self._cond:
            what = self._wait[2] if self._wait is not None and self._wait[0] == step else None
        if what is not None:
            doing = self._elsewhere(states)
            ask = f"{step}:{sorted(waiting_here)}"  # where are you? (whereabouts.Away answers)
            for r in sorted(r for r, s in states.items() if s is None and r != self._rank):
                self._store.set(self._asked_key(r), ask)
            said = explain(
                self._rank, step, waited, states, self._timeout_s, False, doing, self.shutdown_s,
                what=what,
            )  # fmt: skip
            log.warning("%s", said)

    def _elsewhere(self, states: Mapping[int, int | str | None]) -> dict[int, str]:
        """What the ranks without a post wait in instead, where known."""
        if self._doing is None:
            return {}
        known = {r: self._doing(r) for r, s in states.items() if s is None and r != self._rank}
        return {r: what for r, what in known.items() if what}

    def _state(self, rank: int) -> int | str | None:
        if rank == self._rank:
            with self._cond:
                return self._wait[0] if self._wait is not None else None
        key = self._key(rank)
        if self._store.check([key]):
            return int(bytes(self._store.get(key)).decode())
        if self._store.check([finished_key(rank)]):
            return FINISHED
        return None


def standing_in(ranks: Sequence[int], finished_within: Callable[[float], bool]) -> None:
    """Wait for this rank's join() on ``ranks`` (``finished_within(s)``: whether it completed
    within ``s`` seconds), raising :class:`~ringtrain.errors.CollectiveUnsupportedError` as soon
    as a peer waits in a ``step()`` of an optimizer of these ranks that this rank never began:
    the peer would wait until the transport timeout, and this rank with it."""
    watches = [w for w in list(_LIVE) if w.members == list(ranks)]
    while watches and not finished_within(JOIN_LOOK_S):
        for w in watches:
            with exit_guard.native_call() as ok:
                why = w.left_behind() if ok else ""
            if why:
                raise CollectiveUnsupportedError(why)
