"""What the supervisor does when a rank exits: a pure function of the facts, tested alone.

The supervisor (:mod:`ringtrain.launch.supervisor`) gathers the facts of one exit, from the
agent's message and the job's state, into :class:`RankExit`; :func:`decide` names what follows
(:class:`Next`), and the supervisor carries it out. The order of the rules is the policy:

1. a rank the launcher retired on purpose (its host is no longer offered) just stopped;
2. a rank that exited 0 finished: the job is finishing, no new ranks join;
3. after Ctrl-C every end is the interrupt's;
4. after the first failure, a rank the launcher stopped is not a failure, unless it said it
   was failing before (runtime/heartbeat.py), or stopped on a preemption of its own (its end,
   at the step it saved, is the job's stop); any other failure then is listed under the root
   cause (:mod:`ringtrain.launch.failures`);
5. a rank that was joining a running elastic job failed to join;
6. in an elastic job, a started rank that fails is dropped and the world re-formed;
7. otherwise the job fails.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Next(enum.Enum):
    STOPPED = "stopped"  # retired on purpose: log it
    FINISHED = "finished"  # exited 0
    IGNORE = "ignore"  # an end the launcher caused (Ctrl-C, its own stop)
    ALSO_FAILED = "also failed"  # a later failure: listed under the root cause
    JOINER_FAILED = "joiner failed"
    REFORM = "re-form"  # elastic: drop the rank, re-form the world (or wait for hosts)
    FAIL = "fail"  # the job fails: stop every rank


@dataclass(frozen=True)
class RankExit:
    """One rank's exit, with what the supervisor knows of the job at that moment."""

    succeeded: bool  # exit code 0, no signal
    retired: bool = False  # the launcher stopped it on purpose (host no longer offered)
    interrupted: bool = False  # Ctrl-C was pressed
    job_failed: bool = False  # a failure was already acted on
    stopped_by_launcher: bool = False  # its agent signalled it (stop, Ctrl-C)
    said_failing: bool = False  # it said it was failing before it exited
    preempted: bool = False  # it stopped on a preemption at a step it saved (exit code 143)
    joining: bool = False  # started to join a running elastic job, not yet in a world
    elastic: bool = False  # the job re-forms (--min-np)
    started: bool = True  # the agent started its command (a pid was reported)


def decide(e: RankExit) -> Next:
    """What follows ``e``: the rules of the module docstring, in order."""
    if e.retired:
        return Next.STOPPED
    if e.succeeded:
        return Next.FINISHED
    if e.interrupted:
        return Next.IGNORE
    if e.job_failed:
        if e.stopped_by_launcher and not (e.said_failing or e.preempted):
            return Next.IGNORE
        return Next.ALSO_FAILED
    if e.joining:
        return Next.JOINER_FAILED
    if e.elastic and e.started:
        return Next.REFORM
    return Next.FAIL
