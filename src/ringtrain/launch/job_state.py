"""The job's one state, and what each event does to it: pure, tested without processes.

A job is in exactly one phase, and the data that only that phase has travels with it:

=====================  ===========================================================================
``Starting``           agents up, hosts answered, ranks being started
``Running``            every rank started; the launcher relays output and waits for exits
``Reforming``          elastic: a new world was announced or ranks are starting to join one
``WaitingForHosts``    elastic with a discovery script: fewer than ``--min-np`` ranks remain
                       (``since``, and the failure that took the job there)
``Stopping``           a failure or Ctrl-C: every rank is being stopped (``failure``, the
                       deadline after which agents are killed, how many Ctrl-Cs, when the
                       ranks a forwarded signal left running are killed)
``Done``               every agent ended; ``code`` is the launcher's exit code
=====================  ===========================================================================

:func:`on` takes the state and one :class:`Event` and returns the next state with the
:class:`Action` values the supervisor (:mod:`ringtrain.launch.supervisor`) carries out. What a
rank's exit means is decided first by :func:`ringtrain.launch.exit_policy.decide`; the elastic
host pool (:mod:`ringtrain.launch.elastic_hosts`) owns who is in the world.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from ringtrain.launch.failures import Failure

KILL_AFTER_S = 3.0  # past the grace period, agents that have not ended are killed
KILL_AGAIN_S = 5.0  # and again this much later while some still have not


class Phase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    REFORMING = "re-forming"
    WAITING_FOR_HOSTS = "waiting for hosts"
    STOPPING = "stopping"
    DONE = "done"


@dataclass(frozen=True)
class Starting:
    phase = Phase.STARTING


@dataclass(frozen=True)
class Running:
    phase = Phase.RUNNING


@dataclass(frozen=True)
class Reforming:
    generation: int  # the world announced last
    phase = Phase.REFORMING


@dataclass(frozen=True)
class WaitingForHosts:
    since: float  # monotonic time the world fell below --min-np
    failure: Failure  # what took it there (reported if no host comes in time)
    phase = Phase.WAITING_FOR_HOSTS


@dataclass(frozen=True)
class Stopping:
    failure: Failure | None  # the one acted on; None after Ctrl-C alone
    deadline: float  # monotonic time after which the agents are killed
    interrupts: int = 0  # Ctrl-Cs handled
    # After a forwarded signal: when the grace period ends and what still runs is SIGKILLed
    # (never a second SIGTERM: a rank's handler, mid-save, would start over).
    kill_at: float | None = None
    phase = Phase.STOPPING


@dataclass(frozen=True)
class Done:
    code: int
    preempted: bool = False  # stopped on a preemption at a step it saved (AgentsEnded)
    phase = Phase.DONE


State = Starting | Running | Reforming | WaitingForHosts | Stopping | Done


class Action(enum.Enum):
    STOP_RANKS = "stop ranks"  # tell every agent to stop its ranks (SIGTERM, then SIGKILL)
    STOP_RANKS_NOW = "stop ranks now"  # the same without the peers' notice (a launch error)
    FORWARD_SIGNAL = "forward signal"  # SIGINT or SIGTERM, once; killed after the grace period
    KILL_RANKS = "kill ranks"  # SIGKILL every rank still running (the grace period is over)
    KILL_AGENTS = "kill agents"


# ---- events -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    """Every rank of the first world was handed to its agent."""


@dataclass(frozen=True)
class WorldChanged:
    """A new world was announced (a loss re-formed, or ranks started to join)."""

    generation: int


@dataclass(frozen=True)
class Settled:
    """No rank is waiting to join a world any more."""


@dataclass(frozen=True)
class BelowMinNp:
    """Fewer than --min-np ranks remain and a discovery script may offer hosts."""

    now: float
    failure: Failure


@dataclass(frozen=True)
class Failed:
    """The job fails with ``failure`` (``hard``: stop at once, as for a launch error)."""

    failure: Failure
    now: float
    grace_s: float
    hard: bool = False


@dataclass(frozen=True)
class Interrupted:
    """Ctrl-C (or SIGTERM) was received ``count`` times in all."""

    count: int
    now: float
    grace_s: float


@dataclass(frozen=True)
class Tick:
    now: float
    elastic_timeout_s: float = float("inf")


@dataclass(frozen=True)
class AgentsEnded:
    """Every agent has ended (or its link was lost); ``code`` is the launcher's exit code (the
    root cause's, see :mod:`ringtrain.launch.failures`); ``preempted``: the ranks that ended
    the job stopped on a preemption, at a step it saved (failures.stopped_on_preemption)."""

    code: int
    preempted: bool = False


Event = Started | WorldChanged | Settled | BelowMinNp | Failed | Interrupted | Tick | AgentsEnded


@dataclass(frozen=True)
class Decision:
    state: State
    actions: tuple[Action, ...] = ()
    timed_out: Failure | None = None  # WaitingForHosts ran past --elastic-timeout: fail with it


def stopping(state: State) -> bool:
    """Whether the job is ending: no rank starts, no failure is acted on again."""
    return isinstance(state, (Stopping, Done))


def on(state: State, event: Event) -> Decision:
    """The next state after ``event``, and what to do."""
    if isinstance(event, AgentsEnded):
        return Decision(Done(event.code, event.preempted))
    if isinstance(state, Done):
        return Decision(state)
    if isinstance(event, Interrupted):
        return _interrupted(state, event)
    if isinstance(event, Tick):
        return _tick(state, event)
    if isinstance(state, Stopping):  # nothing else changes a job that is ending, but a
        if isinstance(event, Failed) and event.hard:  # launch error stops it at once
            deadline = event.now + KILL_AFTER_S
            return Decision(replace(state, deadline=deadline), (Action.STOP_RANKS_NOW,))
        return Decision(state)
    if isinstance(event, Failed):
        grace = 0.0 if event.hard else event.grace_s
        stop = Action.STOP_RANKS_NOW if event.hard else Action.STOP_RANKS
        return Decision(Stopping(event.failure, event.now + grace + KILL_AFTER_S), (stop,))
    if isinstance(event, Started):
        return Decision(Running() if isinstance(state, Starting) else state)
    if isinstance(event, WorldChanged):
        return Decision(
            state if isinstance(state, WaitingForHosts) else Reforming(event.generation)
        )
    if isinstance(event, BelowMinNp):
        keep = isinstance(state, WaitingForHosts)
        return Decision(state if keep else WaitingForHosts(event.now, event.failure))
    # Settled: the world is whole again (a host came back, the joiners joined or gave up)
    return Decision(Running())


def _interrupted(state: State, e: Interrupted) -> Decision:
    handled = state.interrupts if isinstance(state, Stopping) else 0
    if e.count <= handled:
        return Decision(state)
    failure = state.failure if isinstance(state, Stopping) else None
    if handled == 0:  # the first: forwarded to the ranks, killed after the grace period
        deadline = e.now + e.grace_s + KILL_AFTER_S
        stopping = Stopping(failure, deadline, e.count, kill_at=e.now + e.grace_s)
        return Decision(stopping, (Action.FORWARD_SIGNAL,))
    # A second signal: the user will not wait for the rest of the grace period, if any is left.
    left = isinstance(state, Stopping) and state.kill_at is not None
    stopping = Stopping(failure, e.now + KILL_AFTER_S, e.count)
    return Decision(stopping, (Action.KILL_RANKS,) if left else ())


def _tick(state: State, e: Tick) -> Decision:
    if isinstance(state, Stopping) and state.kill_at is not None and e.now >= state.kill_at:
        return Decision(replace(state, kill_at=None), (Action.KILL_RANKS,))
    if isinstance(state, Stopping) and e.now > state.deadline:
        return Decision(replace(state, deadline=e.now + KILL_AGAIN_S), (Action.KILL_AGENTS,))
    if isinstance(state, WaitingForHosts) and e.now - state.since > e.elastic_timeout_s:
        return Decision(state, timed_out=state.failure)
    return Decision(state)
