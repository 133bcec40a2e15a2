"""The pure planner: which rank runs where, with which placement numbers.

``plan()`` only computes; it starts nothing, so tests check placements without processes, and the
same plan runs locally or over ssh. By default ranks fill hosts in the order given (host-major),
as ``horovodrun`` and ``mpirun --map-by slot`` do; ``placement="round-robin"`` deals them out one
per host in turn instead (``mpirun --map-by node``), the rank order that makes a flat ring cross
hosts at every hop. Local and cross numbering follow Horovod: the cross group of a rank is every
rank with the same local rank, one per host that has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ringtrain.errors import LaunchError
from ringtrain.launch.hosts import Host


@dataclass(frozen=True)
class ProcessSpec:
    rank: int
    size: int
    host: str
    host_index: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    argv: tuple[str, ...]


PLACEMENTS = ("host-major", "round-robin")


def plan(
    np: int, hosts: Sequence[Host], command: Sequence[str], placement: str = "host-major"
) -> list[ProcessSpec]:
    """Place ``np`` ranks on ``hosts`` up to their slots. Hosts left without ranks are dropped."""
    if placement not in PLACEMENTS:
        raise LaunchError(
            f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}.\n"
            "HINT: round-robin deals ranks out one per host in turn."
        )
    capacity = sum(h.slots for h in hosts)
    if np > capacity:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise LaunchError(
            f"-np {np} needs {np} slots but the hosts offer {capacity} ({listed}).\n"
            "HINT: lower -np or give hosts more slots (-H host:SLOTS)."
        )
    # The host index of every rank, in rank order.
    order: list[int] = []
    if placement == "host-major":
        for hi, h in enumerate(hosts):
            order += [hi] * min(h.slots, np - len(order))
    else:
        while len(order) < np:
            for hi, h in enumerate(hosts):
                if len(order) < np and order.count(hi) < h.slots:
                    order.append(hi)
    per_host = [order.count(hi) for hi in range(len(hosts))]
    specs = []
    for rank, hi in enumerate(order):
        local_rank = order[:rank].count(hi)
        having = [j for j, c in enumerate(per_host) if c > local_rank]
        specs.append(
            ProcessSpec(
                rank=rank,
                size=np,
                host=hosts[hi].name,
                host_index=hi,
                local_rank=local_rank,
                local_size=per_host[hi],
                cross_rank=having.index(hi),
                cross_size=len(having),
                argv=tuple(command),
            )
        )
    return specs


def describe(specs: Sequence[ProcessSpec]) -> str:
    """``"4 ranks: host a ranks 0-1, host b ranks 2-3"`` for --verbose and error messages."""
    parts: dict[str, list[int]] = {}
    for s in specs:
        parts.setdefault(s.host, []).append(s.rank)
    shown = ", ".join(f"{h} rank{'s' if len(r) > 1 else ''} {_span(r)}" for h, r in parts.items())
    return f"{len(specs)} rank{'s' if len(specs) != 1 else ''}: {shown}"


def _span(ranks: list[int]) -> str:
    """``0-3`` for consecutive ranks, ``0,2,4`` otherwise (round-robin)."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))
