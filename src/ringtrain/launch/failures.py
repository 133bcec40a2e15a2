"""How a rank's end is worded, and the job's failure report: pure, from the agents' messages.

An agent reports each rank's exit with its code, the signal that killed it, or, for a rank
that stopped sending heartbeats, how long it was silent before the agent killed it
(:func:`how_it_ended`), stamped with the time on its host. The supervisor acts on the first
failure it hears of, and keeps every failure it hears of until the job has stopped (not the
ranks it stopped itself). :func:`report` is the launcher's last message: the **root cause**
first, the failure that happened earliest (not the first whose news arrived: agents on other
hosts report later), with its rank, host, how it ended and the last lines of its error output;
then the others, those with the same last words grouped in one entry (typically every peer
saying that the first rank left). The launcher exits with the root cause's ``code`` (128 + the
signal number for a signal, as a shell does).
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# The launcher's record of how each rank's process ended, in the job's store (non-elastic jobs
# under ``ringtrain run``): ``exited with code 3``. Python tells no at-exit hook the code that
# ``sys.exit(n)`` gives, so a rank cannot post it; its agent sees it, and peers that found only a
# "finished" post read it here (:mod:`ringtrain.runtime.departures`, which imports this).
EXITED_PREFIX = "ringtrain/exited/"


# The record of a rank that ended after the launcher forwarded Ctrl-C or SIGTERM (the same
# key): the job was interrupted, nothing failed; a peer's error says so, with no fix to make.
INTERRUPTED = "the job was interrupted"


def interrupted_words(sig: str) -> str:
    return f"{INTERRUPTED} ({sig} from the launcher)"


# How a durable job's rank ends when it stops on a preemption (checkpoint/preemption.py's
# EXIT_CODE: 128 + SIGTERM, as a shell reports a job that SIGTERM ended).
PREEMPTED_CODE = 128 + int(signal.SIGTERM)


# A rank's exit without last words (``os._exit``) is stamped when its agent reaps it, which its
# polling and a loaded host can delay past the moment its peers say they failed because of it.
EXIT_SEEN_S = 1.0


def exited_key(rank: int) -> str:
    return f"{EXITED_PREFIX}{rank}"


@dataclass
class Failure:
    rank: int | None
    host: str
    code: int
    description: str
    tail: list[str]
    # When it happened: the agent's wall clock at the exit (the launcher's where none came).
    at: float = 0.0
    # The rank's error only says a peer left first (runtime/departures): never the cause
    # while another failure is known.
    after_peer: bool = False
    # Not a failure: the rank exited 0. It is the cause only where it left before every
    # failure and each of them only says a peer left first (:func:`considered`).
    finished: bool = False
    # What to do about it, where its agent could tell (launch/exit_hints): after its last words.
    hint: list[str] = field(default_factory=list)
    # Not a failure either: a durable job's rank stopped on a SIGTERM at a step it saved
    # (checkpoint/preemption.py); the cause only where nothing else failed.
    preempted: bool = False
    # Where a preempted rank said: the step it stopped at, and its (elastic) world's generation.
    stop: tuple[int, int] | None = None


@dataclass
class Interruption:
    """How the ranks ended after the launcher forwarded ``sig``: in time, or killed when the
    grace period ended (or at once, by a second signal). The closing report's facts."""

    sig: str
    grace_s: float
    in_time: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    at_once: bool = False  # a second signal killed them before the grace period ended
    # Of those in time, the ranks that stopped on it as a preemption, at a step the job saved
    # (a durable job's answer to SIGTERM, checkpoint/preemption.py).
    saved: list[int] = field(default_factory=list)

    def ended(self, msg: dict[str, Any]) -> None:
        """Note a rank's end (its agent's ``exit`` message) after the signal."""
        if msg.get("killed"):
            self.killed.append(msg["rank"])
            return
        self.in_time.append(msg["rank"])
        if preempted(msg):
            self.saved.append(msg["rank"])

    def at_a_save(self) -> bool:
        """Whether every rank that ended after the signal stopped at the step the job saved."""
        return not self.killed and bool(self.in_time) and set(self.saved) == set(self.in_time)

    def report(self) -> str:
        what = "job interrupted" if self.sig == "SIGINT" else f"job terminated ({self.sig})"
        period = f"the grace period of {self.grace_s:g} s after {self.sig}"
        if self.at_a_save():
            return (
                f"{what}: every rank stopped within {period} at the step the job saved (to "
                "continue, run the job again with --resume and its checkpoint directory)"
            )
        if not self.killed:
            return f"{what}: every rank exited within {period}"
        lines = [what]
        if self.in_time:
            lines[0] += f": {_ranks(self.in_time)} exited within {period}"
        for rank in sorted(self.killed):
            if self.at_once:
                lines.append(f"rank {rank} was killed at once by the second {self.sig}")
            else:
                lines.append(f"rank {rank} did not exit within {period}; killed")
        if not self.at_once:
            lines.append(
                "HINT: a rank that saves a checkpoint when interrupted may need longer: "
                "--grace-period S (RINGTRAIN_GRACE_PERIOD_S)."
            )
        return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def preempted(msg: dict[str, Any]) -> bool:
    """Whether an agent's ``exit`` message is of a rank that stopped on a preemption: it said
    so (runtime/heartbeat.py), and then ended with the code that stop gives, not an error."""
    return bool(msg.get("preempted")) and msg.get("code") == PREEMPTED_CODE


def how_it_ended(msg: dict[str, Any]) -> tuple[str, int]:
    """``(words, exit code)`` for an agent's ``exit`` message of a rank that did not succeed."""
    code, sig = msg.get("code"), msg.get("signal")
    if preempted(msg):
        return f"stopped on a preemption at a step it saved (exit code {code})", PREEMPTED_CODE
    if msg.get("silent_s") is not None:
        how = f"stopped responding (no heartbeat for {msg['silent_s']:.1f} s) and was killed"
        return how, 128 + int(signal.SIGKILL)
    if sig is not None:
        signum = int(signal.Signals[sig])
        return f"was killed by {sig}", 128 + signum
    return f"exited with code {code}", int(code or 1)


def exit_failure(host: str, msg: dict[str, Any], pid: int | None, elapsed_s: float) -> Failure:
    """How a failed rank's exit (its agent's message) is reported, ``elapsed_s`` into the job;
    ``pid`` None: the agent could not even start the command."""
    rank = msg["rank"]
    how, exit_code = how_it_ended(msg)
    tail = list(msg.get("tail") or [])
    if pid is None:  # the agent's reason first, then perhaps a HINT (agent._cannot_start)
        desc = f"rank {rank} (host {host}) could not start: {tail[0] if tail else how}"
    else:
        desc = f"rank {rank} (host {host}, pid {pid}) {how} after {elapsed_s:.1f} s"
    at = float(msg.get("at") or time.time())
    failure = Failure(rank, host, exit_code, desc, tail, at, bool(msg.get("after_peer")))
    failure.hint = list(msg.get("hint") or [])
    failure.preempted = preempted(msg)
    if failure.preempted and msg.get("preempted_at"):
        step, world = msg["preempted_at"]
        failure.stop = (int(step), int(world))
    return failure


def acted_on(failure: Failure, others: int) -> str:
    """The launcher's line when the first end it hears of stops the job."""
    if not others:
        return f"{failure.description}."
    if failure.preempted:  # the peers learnt of it at the same step: they stop there too
        return f"{failure.description}; the other {others} rank(s) stop at the same step."
    return f"{failure.description}; stopping the other {others} rank(s)."


def recorded_end(msg: dict[str, Any], interruption: Interruption | None) -> str:
    """How a rank's end is recorded for its peers (:func:`exited_key`)."""
    if msg.get("code") == 0 and msg.get("signal") is None:
        return "exited with code 0"
    if interruption is not None and msg.get("stopped"):
        # It ended on the signal its agent forwarded (KeyboardInterrupt, a handler's exit,
        # the grace period's SIGKILL): the job was interrupted, the rank did not fail.
        return interrupted_words(interruption.sig)
    return how_it_ended(msg)[0]


def interrupted_report(sig: str, interruption: Interruption | None) -> str:
    """The last message of a job ended by ``sig``: how each rank ended, where ranks ran."""
    if interruption is not None:
        return interruption.report()
    return "job interrupted" if sig == "SIGINT" else f"job terminated ({sig})"


def considered(failures: Sequence[Failure]) -> list[Failure]:
    """The failures, and the ranks that exited 0 before all of them where every failure only
    says a peer left first: the peers failed because those left (``os._exit(0)`` mid-job, a
    script that ran fewer collectives)."""
    real = [f for f in failures if not f.finished]
    if not real or not all(f.after_peer for f in real):
        return real
    first = min(f.at for f in real) + EXIT_SEEN_S
    return [*real, *(f for f in failures if f.finished and f.at <= first)]


def root_cause(failures: Sequence[Failure]) -> Failure:
    """The failure that happened first (the earliest stamp; the first heard of on a tie),
    among those that are not only a peer's news nor a preemption (unless all are)."""
    every = considered(failures) or list(failures)
    return min(enumerate(every), key=lambda i_f: (_rank_of(i_f[1]), i_f[1].at, i_f[0]))[1]


def _rank_of(f: Failure) -> int:
    """How far down the list of causes ``f`` comes: a real failure first."""
    return 2 if f.after_peer else 1 if f.preempted else 0


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def _last_words(f: Failure) -> tuple[str, ...]:
    """A failure's tail without the rank prefixes torch adds, to group identical ends."""
    return tuple(_RANK_PREFIX.sub("", line) for line in f.tail[-3:])


def report(failures: Failure | Sequence[Failure], absorbed: Sequence[Failure] = ()) -> str:
    """The launcher's closing message for a failed job: the root cause first, then the
    other failures, grouped where their last words are the same. ``absorbed``: failures of an
    elastic job's earlier worlds, which it went on without (listed last, with their times)."""
    heard = [failures] if isinstance(failures, Failure) else list(failures)
    every = considered(heard)
    cause = root_cause(every)
    if stopped_on_preemption(heard):
        return _preempted_report(every, absorbed)
    lines = [f"job failed: {cause.description}"]
    if cause.finished:
        lines[0] += ", while its peers still waited for it (their errors say a peer left)"
    # The live line named the first end heard of ("...; stopping the other ranks"): where that
    # is not the cause, say so, or the two messages read as a contradiction.
    stopper = next((f for f in heard if not f.finished), None)
    first = "the rank that failed first" + (" in the last world" if absorbed else "")
    if stopper is not None and stopper is not cause and stopper.rank is not None:
        lines.append(
            f"(the root cause: {first}; rank {stopper.rank}, whose end was "
            "heard of first and stopped the job, is listed below with the others)"
        )
    elif len(every) > 1 or absorbed:
        lines.append(f"(the root cause: {first}; the others are listed below)")
    if cause.tail:
        who = f"rank {cause.rank}" if cause.rank is not None else f"host {cause.host}"
        lines.append(f"last lines of {who}'s error output:")
        lines.extend(f"  | {t}" for t in cause.tail)
    lines.extend(cause.hint)
    others = sorted((f for f in every if f is not cause), key=lambda f: f.at)
    if others:
        lines.append(f"{len(others)} other rank(s) failed after it:")
        lines.extend(_grouped(others, cause))
    lines.extend(_earlier(absorbed, cause))
    return "\n".join(lines)


def _earlier(absorbed: Sequence[Failure], cause: Failure) -> list[str]:
    """The ranks an elastic job went on without (in earlier worlds), timed from ``cause``."""
    if not absorbed:
        return []
    head = f"earlier, {_left(absorbed)} and the job went on without them (elastic):"
    return [head, *_grouped(sorted(absorbed, key=lambda f: f.at), cause)]


def stopped_on_preemption(
    failures: Sequence[Failure], interruption: Interruption | None = None
) -> bool:
    """Whether a job that did not succeed stopped on a preemption, at a step it saved: every
    rank that ended it said so (:func:`report` then says that, not "job failed"), on a SIGTERM
    of its own or on the launcher's (``interruption``). As for an elastic job's exit code, only
    its last world counts: the ranks it went on without are listed, whatever ended them."""
    every = considered(failures)
    if interruption is not None and interruption.at_a_save():
        return all(f.preempted for f in every)
    return bool(every) and all(f.preempted for f in every)


def _preempted_report(every: Sequence[Failure], absorbed: Sequence[Failure]) -> str:
    """The last message of a job whose ranks all stopped on a preemption, at the step they
    saved: the words of the rank that says which step (rank 0, in checkpoint/durable.py), then
    the ranks an elastic job went on without before."""
    # Ranks signalled together stop at one step of one world, but the launcher hears of them
    # one by one: one whose exit re-formed the world before the others' came stopped with them.
    stops = {f.stop for f in every if f.stop is not None}
    together = [f for f in absorbed if f.preempted and f.stop in stops]
    every = [*every, *together]
    absorbed = [f for f in absorbed if f not in together]
    ranks = sorted(f.rank for f in every if f.rank is not None)
    teller = min(every, key=lambda f: (f.rank is None, f.rank or 0))
    at = f"step {stops.pop()[0]}, " if len(stops) == 1 else ""
    lines = [
        f"job stopped on a preemption: {_ranks(ranks)} exited with code {PREEMPTED_CODE} "
        f"at {at}the step the job saved (to continue, run the job again with --resume and its "
        "checkpoint directory)"
    ]
    if teller.tail:
        lines.append(f"last lines of rank {teller.rank}'s error output:")
        lines.extend(f"  | {t}" for t in teller.tail)
    lines.extend(_earlier(absorbed, teller))
    return "\n".join(lines)


def survived_report(absorbed: Sequence[Failure], ranks: int) -> str:
    """The launcher's closing message for an elastic job that ended well after losing ranks:
    the job's exit is 0 (as Horovod's elastic driver counts only the last world), so without
    this line its log would not say that some of its ranks failed, nor why."""
    lines = [
        f"job finished: the last world's {ranks} rank(s) exited 0; earlier, "
        f"{_left(absorbed)} and the job went on without them (elastic):"
    ]
    lines.extend(_grouped(sorted(absorbed, key=lambda f: f.at), None))
    return "\n".join(lines)


def _left(absorbed: Sequence[Failure]) -> str:
    """How the ranks an elastic job went on without ended: failed, or stopped on a preemption."""
    stopped = sum(f.preempted for f in absorbed)
    failed = len(absorbed) - stopped
    if not stopped:
        return f"{failed} rank(s) failed"
    said = f"{stopped} rank(s) stopped on a preemption"
    return f"{failed} rank(s) failed and {said}" if failed else said


def _grouped(failures: Sequence[Failure], cause: Failure | None) -> list[str]:
    """``failures`` listed, those whose last words are the same together, each timed from the
    cause's (where there is one)."""
    lines: list[str] = []
    groups: dict[tuple[str, ...], list[Failure]] = {}
    for f in failures:
        groups.setdefault(_last_words(f), []).append(f)
    for words, group in groups.items():
        first = group[0]
        later = ""
        # News of a rank can arrive before the cause's own.
        if cause is not None and first.at and cause.at:
            gap = first.at - cause.at
            later = f", {abs(gap):.1f} s {'later' if gap > 0 else 'earlier'}"
            if abs(gap) < 0.05:
                later = ", at about the same time"
        if len(group) == 1:
            lines.append(f"  - {first.description}{later}")
        else:
            ranks = ", ".join(str(f.rank) for f in group if f.rank is not None)
            lines.append(f"  - ranks {ranks} ended alike, the first{later}: {first.description}")
        lines.extend(f"      | {w}" for w in words)
    return lines
