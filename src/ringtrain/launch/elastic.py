"""Elastic membership, the launcher's side: who is in the world, and how ranks are told.

The launcher is the one authority on membership. Each rank gets a stable identity (its first
rank) in ``ID_VAR``; when a rank fails and at least ``--min-np`` remain, the launcher announces a
new generation in the rendezvous store (the member list first, then the generation number) and
the survivors re-form the world in the same processes (:mod:`ringtrain.elastic`). The key names
here are the contract with :mod:`ringtrain.elastic.membership`, which imports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ID_VAR = "RINGTRAIN_ELASTIC_ID"
TIMEOUT_VAR = "RINGTRAIN_ELASTIC_TIMEOUT"
RESET_LIMIT_VAR = "RINGTRAIN_ELASTIC_RESET_LIMIT"
GENERATION_KEY = "ringtrain/elastic/generation"


def members_key(generation: int) -> str:
    return f"ringtrain/elastic/members/{generation}"


def rank_env(identity: int, timeout_s: float, reset_limit: int | None) -> dict[str, str]:
    env = {ID_VAR: str(identity), TIMEOUT_VAR: str(timeout_s)}
    if reset_limit is not None:
        env[RESET_LIMIT_VAR] = str(reset_limit)
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
        True when a new world can go on (at least ``min_np`` remain)."""
        dropped = [i for i in identities if i in self.members]
        for i in dropped:
            self.members.remove(i)
            self.gone.append(i)
        if dropped:
            self.generation += 1
        return len(self.members) >= self.min_np

    def announcement(self) -> list[tuple[str, str]]:
        """The store writes that announce the current world, in the order they must happen."""
        members = json.dumps(self.members, separators=(",", ":"))
        return [(members_key(self.generation), members), (GENERATION_KEY, str(self.generation))]
