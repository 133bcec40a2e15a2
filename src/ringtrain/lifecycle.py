"""Start and stop ringtrain: the composition root that joins the runtime and the collectives.

The runtime layer owns process groups; the collectives layer owns one controller per process set.
This module is the one place that creates both, in the right order, and tears them down in
reverse, so neither layer needs to know about the other's lifecycle.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import hashlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, cast

from ringtrain import environ
from ringtrain.collectives import step_timing
from ringtrain.collectives.controller import Controller
from ringtrain.collectives.objects import allgather_object
from ringtrain.collectives.step_timing import StepTimer
from ringtrain.config import Config
from ringtrain.diagnostics import engine_wait, gil_watch, timeline, trainjob_status
from ringtrain.engine import overlap
from ringtrain.errors import ConfigError, HorovodInternalError, by_rank
from ringtrain.launch import elastic as elastic_launch
from ringtrain.runtime import (
    departures,
    environment,
    exit_guard,
    heartbeat,
    init_arguments,
    membership,
    state,
)
from ringtrain.runtime.arrivals import WorldSuperseded
from ringtrain.runtime.process_sets import ProcessSet
from ringtrain.transport import group_ops
from ringtrain.transport.backend_choice import Backends
from ringtrain.transport.workers import WORKERS

log = logging.getLogger("ringtrain")

# How long shutdown waits for the round that tells the peers this rank leaves (one round while
# their controllers run; longer only when a peer is stopped or holds its GIL), and for a rank
# that fails, which must leave whatever its peers do.
SHUTDOWN_WAIT_S = 30.0
FAILED_SHUTDOWN_WAIT_S = 3.0
_atexit_registered = False

# What exists when this module is first imported is what torch and the script's imports made,
# and it lives as long as the process. Frozen out of the collector's sight (gc.freeze), it is
# skipped by every later collection: shutdown's, the interpreter's last one at exit (together
# 0.3-0.5 s of each rank's end on 2 cores) and the full collections during training. What the
# script makes afterwards is collected as usual; ``gc.unfreeze()`` undoes this.
gc.freeze()


def init(
    comm: init_arguments.Comm = None,
    process_sets: init_arguments.ProcessSets | str | None = None,
    *,
    config: Config | None = None,
    rank: int | None = None,
    size: int | None = None,
    elastic: tuple[int, int, int] | None = None,
    **settings: Any,
) -> None:
    """Join the job. Reads the launcher's variables and ``RINGTRAIN_*`` settings; keyword
    ``settings`` (any :class:`~ringtrain.config.Config` field) override them. ``comm`` and
    ``process_sets`` are Horovod's (:mod:`~ringtrain.runtime.init_arguments`).

    Calling it again while initialized does nothing; after :func:`shutdown` it starts afresh.
    """
    global _atexit_registered
    if state.is_initialized():
        return
    init_arguments.check_comm_type(comm)
    sets = init_arguments.process_sets_of(process_sets)
    beating = heartbeat.start()  # under `ringtrain run`: its agent finds a rank that stops
    if config is None:
        config = Config.from_env(**settings)
    elif settings:
        config = config.replace(**settings)
    if elastic is None and rank is None:
        elastic = _elastic_join()
    rt = _start(config, rank, size, elastic)
    # From here on, an uncaught exception is posted where the peers look (runtime.departures).
    world = state.global_process_set.communicator
    departures.bind(world.store, rt.rank, rt.topology.hosts[rt.rank], world.notes)
    try:
        init_arguments.check_comm(comm, rt.size, _gather_ints)
        _attach_controller(state.global_process_set, config)
        if config.straggler_report_steps > 0 and rt.size > 1:
            _attach_step_timer(rt, config.straggler_report_steps)
        if rt.rank == 0:
            _start_trainjob_status()
        _add_at_init(sets)
        if config.timeline_filename and not timeline.current().enabled:
            # Elastic: a re-formed world keeps the running timeline (one file per process).
            start_timeline(config.timeline_filename)
        # A rank holding the GIL in C says where (its peers cannot); alone, it keeps no one.
        watch_s = gil_watch.timeout_for(config, beating) if rt.size > 1 else 0.0
        gil_watch.start(watch_s, rt.rank, _rounds_led)
    except BaseException:
        gil_watch.stop()
        timeline.stop()
        trainjob_status.stop()
        departures.unbind()
        state.stop()
        raise
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True
    if not faulthandler.is_enabled():
        # A rank that dies of a signal (SIGSEGV, SIGABRT: "terminate called ...") prints every
        # thread's Python stack on its stderr, which the launcher shows: where it was, not
        # just that it died.
        faulthandler.enable()
    log.debug("ringtrain initialized: rank %d/%d", rt.rank, rt.size)


def _gather_ints(mine: int) -> list[int]:
    """Every rank's ``mine``, in rank order (once, at init(comm=...): a one-off, not a hot path)."""
    comm = state.global_process_set.communicator
    if comm.size == 1:
        return [mine]
    every: list[object] = [None] * comm.size
    group_ops.all_gather_object(every, mine, comm.group("cpu"))
    return cast(list[int], every)  # every rank gave an int


def _start(
    config: Config, rank: int | None, size: int | None, elastic: tuple[int, int, int] | None
) -> state.Runtime:
    """``state.start``. In an elastic job, a world the launcher replaced while it gathered (a
    rank was lost before its ``init()``) or made its groups (lost after it arrived) is left for
    the newest one, however often that happens."""
    watching = membership.active() and rank is None
    while True:
        watch = membership.superseded_since() if watching else None
        try:
            return state.start(
                config,
                backends=Backends(),
                rank=rank,
                size=size,
                elastic=elastic,
                superseded=watch,
            )
        except WorldSuperseded:
            world, me = membership.announced_world(), membership.identity()
            if me not in world.members:
                raise HorovodInternalError(
                    f"rank {me} is not in world {world.generation} that the launcher announced "
                    f"while it started ({list(world.members)}): it was considered failed"
                ) from None
            membership.entered(world)
            elastic = (world.members.index(me), len(world.members), world.generation)
            log.warning(
                "ringtrain elastic: generation %d was announced while init() waited for its "
                "world's ranks (members %s); rank %d joins it as rank %d of %d",
                world.generation,
                list(world.members),
                me,
                elastic[0],
                elastic[1],
            )


def _elastic_join() -> tuple[int, int, int] | None:
    """A rank an elastic launcher started on a new host joins the world announced for it."""
    if not membership.joining():
        return None
    world = membership.join()
    return world.members.index(membership.identity()), len(world.members), world.generation


def shutdown() -> None:
    """Leave the job, then free every resource.

    Horovod's rule: the ranks' collectives end with the first rank that shuts down; what the
    others still wait for fails, naming it. The peers hear of it in one control round, which
    this waits for (at most :data:`SHUTDOWN_WAIT_S`). A rank that is failing (an uncaught
    exception: see :mod:`ringtrain.runtime.departures`, or one being raised or handled where
    this is called, in a ``finally:`` or ``except:`` block) waits at most
    :data:`FAILED_SHUTDOWN_WAIT_S` and leaves its process groups undestroyed, so that nothing
    its peers will never answer can hold its exit.
    """
    if not state.is_initialized():
        return
    failure = departures.failure()
    if failure is None:
        failure = departures.raising()
    if failure is None:
        # Raised before leaving: the script sees it, its exit (a failure) leaves and reports it.
        overlap.finish_all("shutdown()")
    _leave(failure)


def _leave(failure: str | None, at_exit: bool = False) -> bool:
    """Shut down; ``failure``: this rank's uncaught exception; ``at_exit``: the script ended
    (or called ``sys.exit(n)``, whose code no hook sees). Returns whether every controller told
    its peers in time (else the groups were abandoned, not destroyed)."""
    rt = state.current()
    told = True
    heartbeat.say(heartbeat.LEAVING)
    try:
        if failure is None and not WORKERS.drain(rt.config.timeout_s):
            log.warning(
                "ringtrain: collectives queued on a group's worker (an overlapped outer "
                "exchange) did not end within timeout_s=%s s; leaving without them",
                rt.config.timeout_s,
            )
        timeline.stop()
        timer = state.global_process_set.communicator.service("step_timer")
        if timer is not None and failure is None:  # a collective: not with peers in doubt
            timer.final_report(state.global_process_set.communicator.store)
        trainjob_status.stop()  # its last post, bounded by the post timeout
        _post_finished(rt.rank)
        if failure is None:  # a failure was posted by the except hook, before the traceback
            departures.post(departures.FINISHED, departures.AT_EXIT if at_exit else "")
        wait = SHUTDOWN_WAIT_S if failure is None else FAILED_SHUTDOWN_WAIT_S
        for ps in sorted(rt.process_sets.values(), key=lambda p: -(p.process_set_id or 0)):
            ctl = ps.communicator.service("controller")
            if ctl is not None:
                told = ctl.request_shutdown(wait, failure or "") and told
    finally:
        gil_watch.stop()
        departures.unbind()
        if told and failure is None:
            state.stop()
        else:
            # Destroying a group waits for its ops in flight, which peers that are gone or
            # stuck never finish: leave them, as an elastic re-forming does.
            _abandon(rt)
    return told


def _abandon(rt: state.Runtime) -> None:
    for ps in rt.process_sets.values():
        ctl = ps.communicator.service("controller")
        if ctl is not None:
            ctl.abandon()
    timer = state.global_process_set.communicator.service("step_timer")
    if timer is not None:
        timer.close()
    state.abandon()


def reform(rank: int, size: int, generation: int) -> None:
    """Elastic: leave the current world without waiting for its peers (one failed), and join
    world ``generation`` as ``rank`` of ``size``. Process sets other than the world are gone."""
    config = None
    if state.is_initialized():
        rt = state.current()
        config = rt.config
        for ps in rt.process_sets.values():
            ctl = ps.communicator.service("controller")
            if ctl is not None:
                ctl.abandon()
        timer = state.global_process_set.communicator.service("step_timer")
        if timer is not None:  # its window is of the old world; the new world gets a new timer
            timer.close()
        trainjob_status.stop()
        state.abandon()
    init(config=config, elastic=(rank, size, generation))


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome/Perfetto trace of this rank's gradient buckets and collectives.

    Every rank writes its own file, ``file_path`` with a rank suffix (``t.json`` ->
    ``t.rank0.json``; elastic jobs: the rank the process started as); returns None, as
    Horovod's does (``timeline.rank_path(file_path, rank)`` names the file). Merge with
    ``python -m ringtrain.diagnostics.timeline merged.json t.rank*.json``. ``mark_cycles`` is
    accepted for Horovod compatibility and ignored. See :mod:`ringtrain.diagnostics.timeline`.
    """
    rank = state.current().rank
    # Elastic jobs renumber ranks: a process's file is named by its first rank (its identity),
    # so it records the whole job in one file and never overwrites another process's.
    rank = int(environ.current().get(elastic_launch.ID_VAR, rank))
    job = environment.job_id(environ.current())  # the merge refuses to join two jobs' files
    timeline.start(timeline.rank_path(file_path, rank), pid=rank, job=job)


def stop_timeline() -> None:
    """Stop recording the timeline and close its file (also done by :func:`shutdown`). Before
    ``init()``, Horovod's ``ValueError`` (:class:`~ringtrain.errors.NotInitializedError`)."""
    state.current()
    timeline.stop()


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank of the world must call this with the same ranks.
    (Always allowed: no ``init(process_sets="dynamic")`` is needed first.) The ranks first
    agree on the set (one small allgather over the world): where they gave different ranks,
    every rank raises, listing each rank's, instead of registering different sets under one
    id."""
    if state.current().size > 1:
        _same_set(process_set)
    return _register(process_set)


def _register(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    ranks = _ranks_of(process_set)
    existing = _registered_as(ranks)
    if existing == state.WORLD_SET_ID:  # Horovod: "Attempted to add a duplicate process set"
        raise ConfigError(
            f"add_process_set({ranks}): these are the ranks of the global process set, which "
            "is always registered (id 0).\nHINT: use hvd.global_process_set (or leave "
            "process_set out) for collectives over every rank."
        )
    if existing is not None:
        raise ConfigError(
            f"a process set with ranks {ranks} is already registered as id {existing}.\n"
            "HINT: pass the ProcessSet that add_process_set() returned the first time."
        )
    ps = state.add_process_set(process_set)
    _attach_controller(ps, state.current().config)
    return ps


def _add_at_init(sets: init_arguments.ProcessSets) -> None:
    """``init(process_sets=...)`` as Horovod's: a set whose ranks the global set or an earlier
    one has is left unregistered (Horovod's ``_init_process_sets`` invalidates it), and init
    fails where none is new (Horovod's "Horovod initialization failed")."""
    new = 0
    for given in sets:
        if state.current().size > 1:
            _same_set(given)  # every rank agrees first, so every rank skips alike
        existing = _registered_as(_ranks_of(given))
        if existing is None:
            _register(given)
            new += 1
        elif not (isinstance(given, ProcessSet) and given.process_set_id == existing):
            log.warning(
                "init(process_sets=...): %s has the ranks of the registered process set %d; "
                "it stays unregistered (as in Horovod): use that set instead.",
                given,
                existing,
            )
    if sets and not new:
        raise ConfigError(
            "init(process_sets=...): no process set given is new: each has the ranks of the "
            "global process set (every rank) or of one before it in the list.\nHINT: leave "
            "process_sets out and use hvd.global_process_set for every rank; give each subset "
            "of the ranks once."
        )


def _ranks_of(process_set: ProcessSet | Sequence[int]) -> list[int]:
    return (process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)).ranks


def _registered_as(ranks: list[int]) -> int | None:
    """The id of the registered process set with these ranks (0: the whole world's)."""
    for set_id, ps in state.current().process_sets.items():
        if ps.ranks == ranks:
            return set_id
    return None


def _same_set(process_set: ProcessSet | Sequence[int]) -> None:
    given = process_set.ranks if isinstance(process_set, ProcessSet) else process_set
    try:
        mine: list[int] | str = sorted(int(r) for r in given)  # a set: ProcessSet sorts too
    except (TypeError, ValueError):
        mine = repr(given)  # refused by state.add_process_set on every rank that gave it
    digest = hashlib.blake2b(repr(mine).encode(), digest_size=8).hexdigest()
    if len(set(allgather_object(digest, "ringtrain.add_process_set"))) == 1:
        return  # the sets themselves travel only where they differ
    told = "\n".join(by_rank(allgather_object(mine, "ringtrain.add_process_set.sets")))
    raise ConfigError(
        "add_process_set: the ranks gave different process sets:\n"
        f"{told}\nHINT: every rank of the world calls add_process_set with the same ranks, in "
        "the same order of calls (members or not); nothing was registered."
    )


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set; every rank of the world must call this."""
    return state.remove_process_set(process_set)


def _post_finished(rank: int) -> None:
    """Tell ranks still waiting in step() that this one has finished (engine_wait)."""
    store = state.global_process_set.communicator.store
    if store is None:
        return
    try:
        store.set(engine_wait.finished_key(rank), "1")
    except Exception as e:  # the store may be gone with a failed job
        log.debug("could not post that rank %d finished: %s", rank, e)


def _attach_controller(ps: ProcessSet, config: Config) -> None:
    comm = ps.communicator
    if comm.included:
        # One board per process: it posts what is stuck on all of this rank's sets under one key.
        world = state.global_process_set.communicator.service("controller")
        board = world.board if world is not None else None
        comm.attach("controller", Controller(comm, config, board=board))


def _rounds_led() -> list[tuple[int, float]]:
    """The control rounds in progress of the sets this rank is rank 0 of (gil_watch.Rounds)."""
    found = []
    for ps in list(state.current().process_sets.values()):
        comm = ps.communicator
        ctl = comm.service("controller")
        if ctl is not None and comm.set_rank == 0 and (since := ctl.round_started) is not None:
            found.append((comm.set_id, since))
    return found


def _attach_step_timer(rt: state.Runtime, every: int) -> None:
    comm = state.global_process_set.communicator
    timer = StepTimer(
        every=every,
        rank=rt.rank,
        host=rt.topology.hosts[rt.rank],
        host_of_rank=list(rt.topology.hosts),
        group=comm.group("engine"),
    )
    comm.attach("step_timer", timer)


def _start_trainjob_status() -> None:
    """Rank 0 posts progress to Kubeflow Trainer where it injected its status endpoint."""
    endpoint = trainjob_status.Endpoint.from_env(environ.current())
    if endpoint is None:
        return
    reporter = trainjob_status.start(endpoint, _straggler_verdict)
    comm = state.global_process_set.communicator
    timer = comm.service("step_timer")
    if timer is None:  # no straggler reports: a timer that only counts steps
        rt = state.current()
        timer = StepTimer(0, rt.rank, rt.topology.hosts[rt.rank], list(rt.topology.hosts), None)
        comm.attach("step_timer", timer)
    timer.on_step = reporter.step_done
    log.debug("posting progress to Kubeflow Trainer at %s", endpoint.url)


def _straggler_verdict() -> str | None:
    report = step_timing.last_report()
    if report is None:
        return None
    if report.kind == "none":
        return "balanced"
    return f"{report.kind}-bound: ranks {','.join(map(str, report.ranks))}"


def _shutdown_at_exit() -> None:
    if not state.is_initialized():
        return
    failure = departures.failure()
    lost = False
    if failure is None and not _interrupted():
        try:
            overlap.finish_all("the script's end")
        except KeyboardInterrupt:  # Ctrl-C while waiting: the job is stopping, leave now
            failure = "KeyboardInterrupt"
        except Exception as e:
            sys.stderr.write(f"ringtrain: {e}\nringtrain: exiting with code 1.\n")
            failure, lost = departures.raising(), True  # posted where the peers look
    try:
        _leave(failure, at_exit=True)
    except Exception as e:  # at exit there is nobody left to raise to
        log.warning("ringtrain shutdown at exit failed: %s", e)
    if lost:  # the script ended as if its last update were done: the launcher must hear not
        exit_guard.settle()
        _exit_now(1)
    if failure is not None and exit_guard.settle(warn=False):
        # A thread is still inside a Gloo wait for a peer that will not answer: the
        # interpreter's finalization would abort the process (SIGABRT) when it returns, and the
        # launcher would report a signal instead of this rank's exit code (Python's 1 for an
        # uncaught exception). Leave with that code now.
        _exit_now(1)


def _interrupted() -> bool:
    """Whether the script ended on an uncaught KeyboardInterrupt (Ctrl-C, the launcher's
    SIGINT): its peers are stopping too, and a pending update would wait for them in vain."""
    return isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)


def _exit_now(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
