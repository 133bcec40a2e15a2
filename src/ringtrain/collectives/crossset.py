"""One collective name submitted on different process sets: a mismatch, not a stall.

Each process set negotiates on a controller of its own, so ranks that submit a collective under
one name but on different sets would wait for each other forever: set A waits for the ranks that
went to set B, and set B for those in A, and no one controller sees both sides.

So the controllers post what is stuck. When a name has waited in a set's table for
:data:`STUCK_AFTER_S`, the rank posts it (the name, the set, who submitted it there) under its own
key in the job's store; the post changes only when what is stuck changes, so a job that never
stalls never writes. A set's rank 0 with a stuck name reads the posts of the ranks it is missing.
If one of them is stuck on the same name on another set, and that set in turn misses a rank that
submitted the name here, neither side can go on: :func:`set_mismatches` returns an error for the
name and every rank of the set fails that collective with it, listing both sides. The other set's
rank 0 finds the same from its side, so every rank involved gets the error; a failed name stays
posted for :data:`LINGER_S`, so the side that decides second still finds the first side's post.

Posts are JSON: the store is shared by the whole job and its contents are never unpickled. In
secure mode they are sealed (they name the user's collectives: :mod:`ringtrain.security.notes`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ringtrain.security.notes import PLAIN, Notes

log = logging.getLogger("ringtrain")

# A name waiting this long in a set's table is posted, and checked against the posts of the
# ranks it misses. Same-name collectives on two sets that are both in flight longer than this,
# each missing ranks that went to the other, are reported as a mismatch.
STUCK_AFTER_S = 1.0
# How often a controller re-checks its table for stuck names (and rank 0 reads posts).
CHECK_EVERY_S = 0.25
# A name failed as a mismatch stays posted this long, for the other set's rank 0 to read.
LINGER_S = 5.0


@dataclass(frozen=True)
class Stuck:
    """A collective that waited at least :data:`STUCK_AFTER_S` in one set's table."""

    name: str
    set_id: int
    set_ranks: tuple[int, ...]  # world ranks of the set
    submitted: tuple[int, ...]  # world ranks that submitted it there

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(r for r in self.set_ranks if r not in self.submitted)

    def to_json(self) -> list[Any]:
        return [self.name, self.set_id, list(self.set_ranks), list(self.submitted)]

    @classmethod
    def from_json(cls, item: Sequence[Any]) -> Stuck:
        name, set_id, set_ranks, submitted = item
        return cls(str(name), int(set_id), tuple(map(int, set_ranks)), tuple(map(int, submitted)))


def _key(world_rank: int) -> str:
    return f"ringtrain/stuck/{world_rank}"


class Board:
    """This process's stuck collectives, over all its process sets, posted in the job's store."""

    def __init__(self, store: Any, world_rank: int, notes: Notes = PLAIN) -> None:
        self._store = store
        self._rank = world_rank
        self._notes = notes
        self._lock = threading.Lock()
        self._by_set: dict[int, tuple[Stuck, ...]] = {}
        self._posted: tuple[Stuck, ...] = ()

    def update(self, set_id: int, stuck: Sequence[Stuck]) -> None:
        """Set what is stuck on one set (called by that set's controller thread). Never raises:
        a store that fails only withholds evidence."""
        with self._lock:
            if stuck:
                self._by_set[set_id] = tuple(stuck)
            else:
                self._by_set.pop(set_id, None)
            content = tuple(s for key in sorted(self._by_set) for s in self._by_set[key])
            if content == self._posted:
                return
            # Under the lock: two sets' controllers must not post out of order.
            try:
                post = json.dumps([s.to_json() for s in content]).encode()
                key = _key(self._rank)
                self._store.set(key, self._notes.seal(key, post))
            except Exception as e:  # a diagnostic must not fail the job: try again next check
                log.debug("could not post stuck collectives: %s", e)
                return
            self._posted = content

    def read(self, world_rank: int) -> tuple[Stuck, ...]:
        """What another rank last posted as stuck (nothing if it never posted)."""
        key = _key(world_rank)
        try:
            if not self._store.check([key]):
                return ()
            post = self._notes.open(key, bytes(self._store.get(key)))
            return tuple(Stuck.from_json(item) for item in json.loads(post.decode()))
        except Exception as e:  # unreadable: no evidence of a mismatch, the stall report stays
            log.debug("could not read rank %d's stuck collectives: %s", world_rank, e)
            return ()


class Watch:
    """One process set's side of the check on this rank: what it posts, when it looks again,
    and (its rank 0) which stuck names are mismatches. The set's controller owns it."""

    def __init__(self, board: Board, set_id: int, ranks: Sequence[int], set_rank: int,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self.board = board
        self._set_id = set_id
        self._ranks = tuple(ranks)
        self._me = self._ranks[set_rank]
        self._clock = clock
        self._next_check = 0.0
        # Names this set failed as mismatches, still posted until the given time.
        self._lingering: dict[str, tuple[Stuck, float]] = {}

    def stuck(
        self, table: Mapping[str, Mapping[int, object]], first_seen: Mapping[str, float]
    ) -> list[Stuck] | None:
        """Names of ``table`` (name -> set rank -> request) that have waited long, posted on
        the board (checked every CHECK_EVERY_S; None between checks)."""
        now = self._clock()
        if now < self._next_check:
            return None
        self._next_check = now + CHECK_EVERY_S
        stuck = [
            self._as_stuck(name, by)
            for name, by in table.items()
            if now - first_seen.get(name, now) >= STUCK_AFTER_S
        ]
        self._lingering = {n: v for n, v in self._lingering.items() if now < v[1]}
        mine = [s for s in stuck if self._me in s.submitted]
        self.board.update(self._set_id, mine + [s for s, _ in self._lingering.values()])
        return stuck

    def linger(self, name: str, submitted: Mapping[int, object]) -> None:
        """Keep posting a name this set failed as a mismatch for a while (``submitted``: its
        set ranks that submitted it): the other set's rank 0 may not have read the post yet,
        and needs it to fail its side too."""
        if self._ranks.index(self._me) not in submitted:
            return
        self._lingering[name] = (self._as_stuck(name, submitted), self._clock() + LINGER_S)

    def mismatches(self, stuck: Sequence[Stuck]) -> tuple[tuple[str, str], ...]:
        """Rank 0: stuck names whose missing ranks went to another set with the same name."""
        missing = {r for s in stuck for r in s.missing}
        posts = {r: self.board.read(r) for r in sorted(missing)}
        return tuple(sorted(set_mismatches(self._set_id, stuck, posts).items()))

    def clear(self) -> None:
        self.board.update(self._set_id, ())  # never raises: a diagnostic

    def _as_stuck(self, name: str, by: Mapping[int, object]) -> Stuck:
        ranks = self._ranks
        return Stuck(name, self._set_id, ranks, tuple(ranks[r] for r in sorted(by)))


def set_mismatches(
    set_id: int,
    stuck_here: Sequence[Stuck],
    posts: Mapping[int, Sequence[Stuck]],
) -> dict[str, str]:
    """The stuck names of set ``set_id`` that can never complete, each with its error message.

    ``posts`` holds what the missing ranks posted. A name is a mismatch when a rank missing here
    is stuck on it on another set that misses a rank which submitted it here.
    """
    found: dict[str, str] = {}
    for here in stuck_here:
        there = [
            s
            for r in here.missing
            for s in posts.get(r, ())
            if s.name == here.name and s.set_id != set_id and set(s.missing) & set(here.submitted)
        ]
        if there:
            found[here.name] = _message(here, there)
    return found


def _message(here: Stuck, there: Sequence[Stuck]) -> str:
    sides = {here.set_id: here}
    for s in there:
        sides.setdefault(s.set_id, s)
    lines = [f"collective {here.name!r} was submitted on different process sets:"]
    for s in sorted(sides.values(), key=lambda s: s.set_id):
        lines.append(
            f"  ranks {list(s.submitted)} on process set {s.set_id} (ranks {list(s.set_ranks)}), "
            f"which also waits for ranks {list(s.missing)}"
        )
    lines.append(
        "HINT: every rank of a process set must submit the collective on that same set "
        "(process_set=...); check which set each rank passes for this name."
    )
    return "\n".join(lines)
