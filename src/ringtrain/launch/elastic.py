"""Elastic membership, the launcher's side: who is in the world, and how ranks are told.

The launcher is the one authority on membership. Each rank gets a stable identity (its first
rank; ranks started later get the next unused numbers) in ``ID_VAR``; when a rank fails and at
least ``--min-np`` remain, or when ranks started on newly discovered hosts are ready, the
launcher announces a new generation in the rendezvous store (the member list first, then the
generation number) and the ranks re-form the world in the same processes
(:mod:`ringtrain.elastic`). A rank started to join a running job (``JOIN_VAR``) first sets its
``ready_key`` and waits for a member list that holds it. The key names here are the contract
with :mod:`ringtrain.runtime.membership`, which imports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ringtrain.environ import Ringtrain

ID_VAR = Ringtrain.ELASTIC_ID
TIMEOUT_VAR = Ringtrain.ELASTIC_TIMEOUT
RESET_LIMIT_VAR = Ringtrain.ELASTIC_RESET_LIMIT
JOIN_VAR = Ringtrain.ELASTIC_JOIN
GENERATION_KEY = "ringtrain/elastic/generation"
# Ranks wait this much longer than --elastic-timeout for a new world: the launcher, which ends
# the job when its own timeout passes, must decide first (a rank that gave up would be taken
# for a failing one).
RANK_WAIT_MARGIN_S = 30.0


def members_key(generation: int) -> str:
    return f"ringtrain/elastic/members/{generation}"


def ready_key(identity: int) -> str:
    return f"ringtrain/elastic/ready/{identity}"


def rank_env(
    identity: int, timeout_s: float, reset_limit: int | None, join: bool = False
) -> dict[str, str]:
    env = {ID_VAR: str(identity), TIMEOUT_VAR: str(timeout_s + RANK_WAIT_MARGIN_S)}
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

    def announcement(self) -> list[tuple[str, str]]:
        """The store writes that announce the current world, in the order they must happen."""
        members = json.dumps(self.members, separators=(",", ":"))
        return [(members_key(self.generation), members), (GENERATION_KEY, str(self.generation))]
