"""``@elastic.run``: retry the training function in the same process when the world changes.

On :class:`HorovodInternalError` (a peer failed mid-collective; ringtrain's
``CollectiveAbortedError`` and torch's ``DistError`` mean the same) the state rolls back to its
last commit; on :class:`HostsUpdatedInterrupt` nothing is lost. Either way the process leaves the
old world without waiting for it, joins the world the launcher announces (renumbered alike on
every rank), runs the reset callbacks, syncs the state from the new rank 0, and calls the
function again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar, cast

import torch.distributed as dist

from ringtrain import lifecycle
from ringtrain.diagnostics import timeline
from ringtrain.elastic.state import State
from ringtrain.engine import optimizer
from ringtrain.errors import (
    CollectiveAbortedError,
    CollectiveArgumentError,
    CollectiveMismatchError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    LaunchError,
    PeerFailedError,
)
from ringtrain.runtime import abort, departures, membership
from ringtrain.runtime import state as runtime

log = logging.getLogger("ringtrain")

R = TypeVar("R")
S = TypeVar("S", bound=State)
P = ParamSpec("P")

# What a peer failing looks like from a survivor: ringtrain's collectives say it in their words,
# the engine's raw Gloo work in torch's, ringtrain's TCP mesh (enclaves, secure elastic jobs) as
# a ConnectionError. Mismatched or invalid calls are HorovodInternalErrors too (as in Horovod)
# but would fail again in any world: they end the job instead of a reset.
PEER_FAILED: tuple[type[BaseException], ...] = (
    HorovodInternalError,
    CollectiveAbortedError,
    dist.DistError,
    ConnectionError,
)


def peer_failed(e: BaseException) -> bool:
    """Whether ``e`` means a peer failed (so re-forming the world can help)."""
    if isinstance(e, (CollectiveArgumentError, CollectiveMismatchError)):
        return False
    if isinstance(e, PEER_FAILED):
        return True
    # HACK: the engine waits on raw Gloo work, whose transport errors reach us as plain
    # RuntimeErrors; recognise them by Gloo's source path in the message.
    text = str(e)
    return isinstance(e, RuntimeError) and "gloo/transport" in text


def run(func: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Decorate ``train(state, *args, **kwargs)``; call it with a committed :class:`State`."""

    @functools.wraps(func)
    def wrapper(state: S, *args: P.args, **kwargs: P.kwargs) -> R:
        if membership.active():
            abort.announced = membership.newest
            # A rank that joined a running job starts in a later world: not news to it.
            state.mark_generation(membership.current())
        resets = 0
        skip_sync = False
        while True:
            # The sync inside the try, as in Horovod: a peer lost while the state is broadcast
            # (the first sync, or the one after a reset) re-forms the world like any other.
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                failure: BaseException | None = None
                skip_sync = e.skip_sync
            except Exception as e:
                if not peer_failed(e):
                    raise
                failure = e
                skip_sync = False
            resets += 1
            limit = membership.reset_limit()
            if limit is not None and resets > limit:
                raise LaunchError(
                    f"the world was re-formed {resets} time{'s' if resets != 1 else ''}, more than "
                    f"--reset-limit {limit}"
                ) from failure
            _reset(state, failure)
            if failure is not None:
                # Into the new world's objects, not the old one's: a sharded optimizer's old
                # shards, which a restore before the re-forming filled, go with the old world.
                state.restore()
            state.on_reset()

    # ``state`` may also be passed by name (as Horovod's wrapper takes it), which Concatenate
    # cannot say: the wrapper's type is the function's.
    return cast("Callable[Concatenate[S, P], R]", wrapper)


def _reset(state: State, failure: BaseException | None) -> None:
    if not membership.active():
        if failure is not None:  # no elastic launcher: nobody can say who is left
            raise failure
        lifecycle.shutdown()  # hosts changed by hand (tests, Horovod's own semantics)
        lifecycle.init()
        optimizer.rejoin_all()
        return
    if failure is not None:
        # Where no rank left (this rank's own connection broke), nothing but this rank's
        # request brings a new world; where the launcher announced one already (the failure
        # was the wait leaving the old world), there is nothing to ask.
        announced = membership.newest() > membership.current()
        # Said before the wait, which may be long, while the peers' stall reports show only
        # that this rank is inside the wrapper.
        log.warning(
            "ringtrain elastic: rank %s: %s; re-forming: %s",
            runtime.current().rank if runtime.is_initialized() else "?",
            departures.summary(failure),
            "joining the world the launcher announced"
            if announced
            else "asked the launcher for a new world, waiting up to "
            f"{membership.timeout_s():.0f} s for it",
        )
        if not announced:
            membership.ask_reform()
    world = membership.next_world(failed=failure is not None)
    me = membership.identity()
    if me not in world.members:
        raise HorovodInternalError(
            f"rank {me} is not in world {world.generation} the launcher announced "
            f"({list(world.members)}): it was considered failed"
        ) from failure
    old = runtime.current().rank if runtime.is_initialized() else None
    before = membership.members(runtime.current().size if runtime.is_initialized() else 0)
    membership.entered(world)  # first: the new world's waits must not count as superseded
    lifecycle.reform(world.members.index(me), len(world.members), world.generation)
    # A newer world announced while this one gathered was joined instead (lifecycle._start).
    world = membership.Roster(membership.current(), membership.members(runtime.current().size))
    optimizer.rejoin_all()
    state.mark_generation(world.generation)
    change = describe_change(before, world, failure)
    log.warning(
        "ringtrain elastic: generation %d: %s; rank %s is now rank %d of %d",
        world.generation,
        change,
        old,
        world.members.index(me),
        len(world.members),
    )
    timeline.current().instant(
        "elastic",
        "WORLD CHANGE",
        time.perf_counter(),
        {
            "generation": world.generation,
            "rank": world.members.index(me),
            "size": len(world.members),
            "members": list(world.members),
            "change": change,
        },
    )


def describe_change(
    before: tuple[int, ...], world: membership.Roster, failure: BaseException | None
) -> str:
    """Who left and who joined (by the rank each started as), and why, in one phrase."""
    left = [m for m in before if m not in world.members]
    joined = [m for m in world.members if m not in before]
    parts = []
    if left:
        parts.append(f"rank(s) {left} left")
    if joined:
        parts.append(f"rank(s) {joined} joined")
    what = " and ".join(parts) or "the world was re-formed"
    if failure is None:
        return f"{what} (the launcher announced new hosts)"
    first = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
    first = departures.unplaced(first)
    if len(first) > REASON_CHARS:
        first = first[:REASON_CHARS].rsplit(" ", 1)[0] + " ..."
    # No rank left: the same ranks re-formed because a rank's collective failed (it asked).
    cause = "a peer failed" if left else "a collective failed"
    if left and isinstance(failure, PeerFailedError) and failure.preempted:
        cause = "a peer stopped on a preemption"
    return f"{what} ({cause}: {type(failure).__name__}: {first})"


REASON_CHARS = 200  # of the failure's first line in the one-line report
