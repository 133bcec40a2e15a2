"""What a process set does in a round that carries shutdown votes: pure, from the round.

Every rank holds the same round's messages and the same table of pending names, so every rank
decides alike, with no further round:

* a rank that *fails* (its vote carries its uncaught exception, see
  :mod:`ringtrain.runtime.departures`) ends the set in the round that carries its vote: what
  that round made ready still runs, everything still pending fails with
  :class:`~ringtrain.errors.PeerFailedError` naming the rank and quoting its exception, and so
  do later submissions. It leaves in one round, whatever its peers wait for;
* a rank that *finishes* keeps taking part until nothing is pending on any rank (its peers'
  last ops may still need rounds: the fast lane decides slots there), then the set ends
  (Horovod's rule: the ranks' collectives end with the first that shuts down). A name it never
  submitted can never run: it fails on the ranks that wait for it, naming the rank that left.
  So a peer waiting elsewhere (in ``step()``) does not hold the finished rank back, and that
  peer's wait then ends with the rank's departure, named (:mod:`ringtrain.runtime.departures`);
* when every rank has voted, the set ends at once.

``tests/collectives/test_shutdown_rules.py`` holds each rule without a process.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ringtrain.errors import (
    RAN_FEWER,
    CollectiveAbortedError,
    CollectiveError,
    PeerFailedError,
    SecurityError,
)

SHUT_DOWN = "ringtrain shut down before this collective completed"


@dataclass
class Ending:
    """How this rank's part of the set ends: the controller's, read and written under its lock
    (the submitting threads read it too)."""

    shutdown: bool = False  # this rank votes to leave
    leaving: str = ""  # why: "" (it finished) or its failure, quoted to the peers
    closed: bool = False  # the set has ended here (or was abandoned)
    failure: CollectiveError | SecurityError | None = None  # what pending and later ops get


@dataclass(frozen=True)
class Vote:
    """One rank's part of a round, as far as shutdown goes."""

    shutdown: bool = False
    leaving: str = ""  # with shutdown: its failure ("ValueError: boom"); "" if it finished
    busy: bool = False  # it has collectives in flight


def set_ends(votes: Sequence[Vote], table: Mapping[str, Collection[int]]) -> bool:
    """Whether the set ends in this round (``table``: pending names, after this round ran what
    it made ready, with the set ranks that submitted each)."""
    if not any(v.shutdown for v in votes):
        return False
    failing = any(v.shutdown and v.leaving for v in votes)
    quiet = not table and not any(v.busy for v in votes if not v.shutdown)
    return failing or quiet or all(v.shutdown for v in votes)


def doomed(
    votes: Sequence[Vote], table: Mapping[str, Collection[int]], joined: Collection[int]
) -> dict[str, list[int]]:
    """Pending names that can never run: ``name -> the ranks that left without submitting it``
    (joined ranks stand in for theirs, as Horovod's join does)."""
    gone = {r for r, v in enumerate(votes) if v.shutdown}
    out = {}
    for name, submitted in table.items():
        missing = gone - set(submitted) - set(joined)
        if missing:
            out[name] = sorted(missing)
    return out


def error(
    votes: Sequence[Vote],
    me: int,
    ranks: Sequence[int],
    set_id: int,
    only: Collection[int] | None = None,
) -> CollectiveError:
    """What ops still pending fail with on set rank ``me``: the peers that left, named
    (``only``: those set ranks; ``ranks``: the set's world ranks)."""
    gone = [
        (r, v)
        for r, v in enumerate(votes)
        if v.shutdown and r != me and (only is None or r in only)
    ]
    mine = votes[me]
    if not gone or (mine.shutdown and not mine.leaving):
        return CollectiveAbortedError(SHUT_DOWN)
    gone.sort(key=lambda rv: not rv[1].leaving)  # failures first
    named = tuple(ranks[r] for r, _ in gone)
    lines = []
    for rank, (_, v) in zip(named, gone):
        if v.leaving:
            lines.append(f"rank {rank} failed ({v.leaving}) and left the job")
        elif set_id == 0:
            lines.append(f"rank {rank} shut down (its script ended or called shutdown())")
        else:  # a set also ends on a rank that removed it
            lines.append(
                f"rank {rank} left the set (its script ended, or it called shutdown() or "
                "remove_process_set())"
            )
    hint = (
        "the failure above is the cause; fix it and start the job again."
        if gone[0][1].leaving
        else RAN_FEWER
        + ("" if set_id == 0 else " Every rank of the world calls remove_process_set alike.")
    )
    return PeerFailedError(
        f"ringtrain has been shut down on process set {set_id}: "
        + "; ".join(lines)
        + f", before this collective completed.\nHINT: {hint}",
        named,
        exits_unread=not gone[0][1].leaving,
    )
