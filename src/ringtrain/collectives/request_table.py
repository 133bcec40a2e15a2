"""What every rank of a process set holds alike about pending collectives: the table of names
each rank submitted, the request cache, and which ranks have joined.

The controller fills it from each round's messages in the same order on every rank, so every
rank decides from the same table: which names are ready (every rank submitted them, or joined
ranks stand in for the missing), and which number in the request cache (Horovod's response
cache) means which request. Only the controller's thread touches it, except
:meth:`RequestTable.cache_id` and :meth:`RequestTable.repeat_of`, dict reads a submitting
thread may make.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ringtrain.collectives import inline, resubmit
from ringtrain.collectives.requests import Request
from ringtrain.diagnostics import stall


class RequestTable:
    """Pending names by set rank, their inline payloads and first sighting; joined ranks; and
    the request cache (requests every rank made alike, numbered in the order they ran)."""

    def __init__(self, capacity: int) -> None:
        self.by_name: dict[str, dict[int, Request]] = {}
        self.inline: dict[str, dict[int, inline.Payload]] = {}  # by name, then set rank
        self.first_seen: dict[str, float] = {}
        self.joined: set[int] = set()  # set ranks
        self.last_joined = -1  # the world rank of the last rank to join
        self.cache: list[Request] = []
        self._ids: dict[Request, int] = {}
        self._capacity = capacity
        # The cached request last run under each name that a call of one tensor submits, for
        # that call's repeats (repeat_of); as bounded as the cache.
        self._repeats: dict[str, resubmit.Repeat] = {}

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def add(
        self,
        set_rank: int,
        world_rank: int,
        items: Sequence[Request | int],
        payloads: Mapping[int, inline.Payload],
        now: float,
    ) -> None:
        """Set rank ``set_rank``'s message: its requests (a number: the request cache's), with
        ``payloads[i]`` the data of ``items[i]`` sent inline. One call per message: a gathered
        round at N ranks adds N messages of up to a few hundred requests each."""
        by_name, cache = self.by_name, self.cache
        for i, item in enumerate(items):
            req = cache[item] if isinstance(item, int) else item
            entry = by_name.setdefault(req.name, {})
            if not entry:
                self.first_seen[req.name] = now
            entry[set_rank] = req
            if i in payloads:
                self.inline.setdefault(req.name, {})[set_rank] = payloads[i]
            if req.kind == "join":
                self.joined.add(set_rank)
                self.last_joined = world_rank

    def is_ready(self, name: str, size: int, join_name: str) -> bool:
        """Every rank submitted ``name``, or the ranks that did not have joined (never for
        the join itself, which waits for every rank)."""
        submitted = self.by_name[name]
        if len(submitted) == size:
            return True
        if name == join_name or not self.joined:
            return False
        active = set(range(size)) - self.joined
        return bool(active) and active <= set(submitted)

    def take(self, name: str) -> tuple[dict[int, Request], dict[int, inline.Payload] | None]:
        """Remove a ready name: (its requests by set rank, its inline payloads if any)."""
        self.first_seen.pop(name, None)
        return self.by_name.pop(name), self.inline.pop(name, None)

    def drop(self, name: str) -> None:
        """Forget a name that failed (alike on every rank)."""
        self.by_name.pop(name, None)
        self.first_seen.pop(name, None)
        self.inline.pop(name, None)

    def alike(self, name: str, size: int) -> Request | None:
        """The request of ``name`` if every rank submitted it identically and no rank joined."""
        by_rank = self.by_name[name]
        if len(by_rank) != size or self.joined:
            return None
        req = by_rank[0]
        return req if all(r == req for r in by_rank.values()) else None

    def waits_on(self, set_rank: int) -> bool:
        """Whether ``set_rank`` submitted a name that still waits for others."""
        return any(set_rank in by for by in self.by_name.values())

    def waiting(self, now: float, for_s: float = 0.0) -> dict[str, stall.Waiting]:
        """The names pending for at least ``for_s`` seconds, as the stall inspector reads them.
        ``first_seen`` holds names in the order they were first seen, so the scan ends at the
        first newer one: rank 0 asks every round, and a burst keeps hundreds pending."""
        out: dict[str, stall.Waiting] = {}
        for name, since in self.first_seen.items():
            if now - since < for_s:
                break
            out[name] = stall.Waiting(name, tuple(sorted(self.by_name.get(name, ()))), since)
        return out

    # ---- the request cache ------------------------------------------------------------------

    def repeat_of(
        self, name: str, t: torch.Tensor, op: str, prescale: float, postscale: float
    ) -> Request | None:
        """The cached request an allreduce of ``t`` with these arguments submits, else None (a
        dict read, as cache_id: submitting threads ask)."""
        r = self._repeats.get(name)
        return r.request if r is not None and r.matches(name, t, op, prescale, postscale) else None

    def cache_id(self, req: Request) -> int:
        """``req``'s number in the request cache, or -1."""
        return self._ids.get(req, -1)

    def remember(self, by_rank: dict[int, Request]) -> None:
        """Cache a request every rank made alike. Called in the ready order, which every rank
        shares, so a number means the same request everywhere."""
        req = next(iter(by_rank.values()))
        if req in self._ids or len(self.cache) >= self._capacity:
            return
        if req.kind == "join" or any(r != req for r in by_rank.values()):
            return
        self._ids[req] = len(self.cache)
        self.cache.append(req)
        if (repeat := resubmit.of(req)) is not None:
            self._repeats[req.name] = repeat
