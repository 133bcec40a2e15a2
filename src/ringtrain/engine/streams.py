"""Streams: the process groups (and hierarchical allreduces) that gradient buckets travel on.

A :class:`Route` is one Gloo group, plus a :class:`~ringtrain.transport.hierarchical.
HierarchicalAllreduce` when buckets go hierarchically. Bucket ``i`` of a plan travels on stream
``i % streams``: a deterministic round robin, so every rank issues the same collectives on the same
group in the same order, and consecutive buckets are in flight at once on separate connections
(``Config.engine_streams``).

Groups are made once per process set by a :class:`StreamPool` attached to the set's communicator
(service :data:`SERVICE`) and shared by every DistributedOptimizer on it. Making a group is
collective over the *world* (``new_group`` numbers groups by call order), so the pool serves only
the world process set, and is asked at one point every rank reaches alike: when an optimizer
makes its first bucket plan. Other process sets use their one ``engine`` group.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ringtrain.errors import InternalError
from ringtrain.runtime.communicator import Communicator
from ringtrain.transport import group_ops
from ringtrain.transport.hierarchical import HierarchicalAllreduce

log = logging.getLogger("ringtrain")

SERVICE = "engine_streams"


@dataclass(frozen=True)
class Route:
    """Where a bucket travels: a process group, and optionally a hierarchical allreduce."""

    group: Any
    hierarchical: HierarchicalAllreduce | None = None


class StreamPool:
    """The extra engine groups and hierarchical allreduces of the world process set."""

    def __init__(self, comm: Communicator, timeout_s: float) -> None:
        engine = comm.group("engine")
        self._ranks = list(comm.ranks)
        self._groups: list[Any] = [engine]
        self._hierarchical: list[HierarchicalAllreduce] = []
        self._hosts: tuple[Hashable, ...] | None = None
        self._spares: dict[str, Any] = {}
        # Sealed jobs seal every group: the extra ones use the engine group's own backend.
        self._backend = group_ops.backend(engine)
        self._timeout = datetime.timedelta(seconds=timeout_s)

    @classmethod
    def of(cls, comm: Communicator, timeout_s: float) -> StreamPool:
        pool = comm.service(SERVICE)
        if pool is None:
            pool = cls(comm, timeout_s)
            comm.attach(SERVICE, pool)
        return pool

    def spare(self, name: str) -> Any:
        """A group of its own for ``name``, made at the first ask (collective then, like
        :meth:`streams`): the overlap's sharded step all-gathers on one, from its updater thread,
        so no other thread's collectives share that group's order."""
        if name not in self._spares:
            self._spares[name] = self._new_group()
        return self._spares[name]

    def _new_group(self) -> Any:
        return group_ops.new_group(self._ranks, self._backend, self._timeout)

    def streams(self, count: int, hosts: Sequence[Hashable] | None = None) -> list[Route]:
        """``count`` streams, hierarchical over ``hosts`` (host of every world rank) if given.

        Collective whenever it has to make groups: every rank must ask for the same, in the same
        order relative to every other group creation."""
        while len(self._groups) < count:
            self._groups.append(self._new_group())
        if hosts is None:
            return [Route(g) for g in self._groups[:count]]
        hosts = tuple(hosts)
        if self._hosts is not None and self._hosts != hosts:
            raise InternalError(f"the placement changed from {self._hosts} to {hosts}")
        self._hosts = hosts
        while len(self._hierarchical) < count:
            self._hierarchical.append(
                HierarchicalAllreduce(hosts, backend=self._backend, timeout=self._timeout)
            )
        return [Route(g, h) for g, h in zip(self._groups[:count], self._hierarchical)]

    def close(self) -> None:
        for h in self._hierarchical:
            h.close()
        self._hierarchical.clear()
        # The extra flat groups are world groups: they die with the default group.
        self._groups = self._groups[:1]
        self._spares.clear()
