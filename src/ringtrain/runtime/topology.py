"""The real host placement of the ranks, and the local/cross numbering derived from it.

Launchers disagree about what "local" means and placements may be uneven (4-3-1), so local and
cross ranks are computed from the host every rank reports, never from the launcher's counts. A
host is what the launcher names one where it does (its node: ringtrain's host spec, torchrun's
node rank, Slurm's node, a pod); otherwise a hostname together with the address of the interface
the job uses, so that two machines with one hostname (cloned VMs, containers) stay two hosts.
Numbering follows Horovod: ``local_rank`` counts ranks on the same host; the *cross* communicator
of a rank holds every rank with the same ``local_rank`` (one per host that has that many ranks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """Where every rank of the world runs. ``hosts[r]`` is rank r's host name."""

    hosts: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def host_names(self) -> tuple[str, ...]:
        """Distinct hosts in order of their lowest rank."""
        return tuple(dict.fromkeys(self.hosts))

    def ranks_on(self, host: str) -> tuple[int, ...]:
        return tuple(r for r, h in enumerate(self.hosts) if h == host)

    def local_rank(self, rank: int) -> int:
        return self.ranks_on(self.hosts[rank]).index(rank)

    def local_size(self, rank: int) -> int:
        return len(self.ranks_on(self.hosts[rank]))

    def cross_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks sharing ``rank``'s local rank, one per host, in host order."""
        lr = self.local_rank(rank)
        return tuple(r for r in range(self.size) if self.local_rank(r) == lr)

    def cross_rank(self, rank: int) -> int:
        return self.cross_ranks(rank).index(rank)

    def cross_size(self, rank: int) -> int:
        return len(self.cross_ranks(rank))

    def local_groups(self) -> list[tuple[int, ...]]:
        """One group of ranks per host, in host order."""
        return [self.ranks_on(h) for h in self.host_names]

    def cross_groups(self) -> list[tuple[int, ...]]:
        """One group per local rank: the ranks that hold that local rank on their host."""
        deepest = max(len(g) for g in self.local_groups())
        return [
            tuple(r for r in range(self.size) if self.local_rank(r) == lr) for lr in range(deepest)
        ]

    @property
    def is_homogeneous(self) -> bool:
        """True when every host runs the same number of ranks."""
        return len({len(g) for g in self.local_groups()}) == 1

    @property
    def is_host_major(self) -> bool:
        """True when each host's ranks are consecutive (0-3 on a, 4-7 on b), not round-robin."""
        return all(g == tuple(range(g[0], g[0] + len(g))) for g in self.local_groups())

    def describe(self) -> str:
        """A short placement summary such as ``4-3-1 over 3 hosts``."""
        counts = "-".join(str(len(g)) for g in self.local_groups())
        return f"{counts} over {len(self.host_names)} host(s)"


def from_hosts(hosts: Sequence[str]) -> Topology:
    return Topology(tuple(hosts))


@dataclass(frozen=True)
class HostIdentity:
    """What one rank reports about its host: a ``name`` for people (a hostname, or the host
    spec it was launched on) and a ``key`` that tells hosts apart (the launcher's node, or the
    interface's address)."""

    name: str
    key: str


def from_identities(ids: Sequence[HostIdentity]) -> Topology:
    """The topology of ranks that reported ``ids`` (by rank): ranks with equal ``(name, key)``
    share a host. A host is named by its ``name`` alone where no other host has that name, else
    by ``name[key]``, so that messages keep naming hosts as people know them."""
    keys_of: dict[str, set[str]] = {}
    for i in ids:
        keys_of.setdefault(i.name, set()).add(i.key)
    return Topology(
        tuple(i.name if len(keys_of[i.name]) == 1 else f"{i.name}[{i.key}]" for i in ids)
    )
