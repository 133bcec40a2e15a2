"""Elastic membership, the launcher's side: who is in the world, and how ranks are told.

The launcher is the one authority on membership. Each rank gets a stable identity (its first
rank; ranks started later get the next unused numbers) in ``ID_VAR``; when a rank fails and at
least ``--min-np`` remain, or when ranks started on newly discovered hosts are ready, the
launcher announces a new generation in the rendezvous store (the member list first, then the
generation number) and the ranks re-form the world in the same processes
(:mod:`ringtrain.elastic`). A rank started to join a running job (``JOIN_VAR``) first sets its
``ready_key`` and waits for a member list that holds it. A rank whose collective failed while
no rank left (its own connection broke) sets its ``reform_key`` for its world: the launcher then
announces the same members as a new world (:class:`ReformRequests`), as Horovod's driver does
once its workers re-initialise. The key names here are the contract with
:mod:`ringtrain.runtime.membership`, which imports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from ringtrain.environ import Ringtrain

ID_VAR = Ringtrain.ELASTIC_ID
TIMEOUT_VAR = Ringtrain.ELASTIC_TIMEOUT
RESET_LIMIT_VAR = Ringtrain.ELASTIC_RESET_LIMIT
JOIN_VAR = Ringtrain.ELASTIC_JOIN
MIN_NP_VAR = Ringtrain.ELASTIC_MIN_NP
GENERATION_KEY = "ringtrain/elastic/generation"
# Ranks wait this much longer than --elastic-timeout for a new world: the launcher, which ends
# the job when its own timeout passes, must decide first (a rank that gave up would be taken
# for a failing one).
RANK_WAIT_MARGIN_S = 30.0
# A re-form request stands this long before it is granted: where a rank's exit caused the
# failure, the launcher sees that exit meanwhile and re-forms the world without it instead (a
# job of 64 ranks on 2 busy cores ended 2-5 s after a rank's exit: docs/launch.md).
REFORM_GRACE_S = 5.0


def members_key(generation: int) -> str:
    return f"ringtrain/elastic/members/{generation}"


def ready_key(identity: int) -> str:
    return f"ringtrain/elastic/ready/{identity}"


def reform_key(generation: int, identity: int) -> str:
    return f"ringtrain/elastic/reform/{generation}/{identity}"


def rank_env(
    identity: int, timeout_s: float, reset_limit: int | None, join: bool, min_np: int
) -> dict[str, str]:
    """An elastic rank's variables; ``min_np``: the fewest ranks the job goes on with (a
    rank that stops on a preemption says whether its peers go on, checkpoint/durable.py)."""
    env = {ID_VAR: str(identity), TIMEOUT_VAR: str(timeout_s + RANK_WAIT_MARGIN_S)}
    env[MIN_NP_VAR] = str(min_np)
    if reset_limit is not None:
        env[RESET_LIMIT_VAR] = str(reset_limit)
    if join:
        env[JOIN_VAR] = "1"
    return env


@dataclass
class Membership:
    """The current world: identities in new-rank order, and its generation."""

    members: list[int]
    min_np: int
    generation: int = 0
    gone: list[int] = field(default_factory=list)

    def lose(self, *identities: int) -> bool:
        """Drop failed ranks (a lost host's, together: one new world, not one per rank).
        True when a new world can go on (at least ``min_np`` remain); only then is a new
        generation taken, so the generations announced stay consecutive."""
        dropped = [i for i in identities if i in self.members]
        for i in dropped:
            self.members.remove(i)
            self.gone.append(i)
        enough = len(self.members) >= self.min_np
        if dropped and enough:
            self.generation += 1
        return enough

    def add(self, *identities: int) -> None:
        """Ranks started on new hosts join: one new world for all of them."""
        new = [i for i in identities if i not in self.members]
        if new:
            self.members.extend(new)
            self.generation += 1

    def again(self) -> None:
        """The same members re-form as a new world (a rank asked: :class:`ReformRequests`)."""
        self.generation += 1

    def announcement(self) -> list[tuple[str, str]]:
        """The store writes that announce the current world, in the order they must happen."""
        members = json.dumps(self.members, separators=(",", ":"))
        return [(members_key(self.generation), members), (GENERATION_KEY, str(self.generation))]


class Store(Protocol):
    """The launcher's side of the rendezvous store (:class:`ringtrain.launch.rendezvous`)."""

    def present(self, keys: list[str], timeout_s: float = ...) -> set[str]: ...
    def publish(self, key: str, value: str) -> None: ...


@dataclass
class ReformRequests:
    """Re-form requests of the current world's ranks, granted :data:`REFORM_GRACE_S` after the
    first one unless another change came first (both elastic launchers own one)."""

    generation: int = -1  # the world the first request seen was for
    since: float = 0.0  # when it was seen (monotonic)

    def poll(self, m: Membership, store: Store, now: float, finished: bool) -> list[int]:
        """The ranks that asked, once the world is re-formed for them (announced in ``store``);
        empty while none asked or the request is still within its grace. ``finished``: a rank
        finished, so the same ranks cannot form a world again; nor can fewer than --min-np
        (the launcher waits for hosts)."""
        if finished or len(m.members) < m.min_np:
            return []
        keys = [reform_key(m.generation, i) for i in m.members]
        have = store.present(keys)
        asked = [i for i, k in zip(m.members, keys, strict=True) if k in have]
        if not asked:
            return []
        if self.generation != m.generation:
            self.generation, self.since = m.generation, now
        if now - self.since < REFORM_GRACE_S:
            return []
        m.again()
        for key, value in m.announcement():
            store.publish(key, value)
        return asked
