"""The pure planner: which rank runs where, with which placement numbers.

``plan()`` only computes; it starts nothing, so tests check placements without processes, and the
same plan runs locally or over ssh. Ranks fill hosts in the order given (host-major), as
``horovodrun`` and ``mpirun --map-by slot`` do; local and cross numbering follow Horovod: the
cross group of a rank is every rank with the same local rank, one per host that has it.
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


def plan(np: int, hosts: Sequence[Host], command: Sequence[str]) -> list[ProcessSpec]:
    """Place ``np`` ranks on ``hosts`` up to their slots. Hosts left without ranks are dropped."""
    capacity = sum(h.slots for h in hosts)
    if np > capacity:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise LaunchError(
            f"-np {np} needs {np} slots but the hosts offer {capacity} ({listed}).\n"
            "HINT: lower -np or give hosts more slots (-H host:SLOTS)."
        )
    per_host: list[int] = []
    left = np
    for h in hosts:
        take = min(h.slots, left)
        if take == 0:
            break
        per_host.append(take)
        left -= take
    specs = []
    rank = 0
    for hi, count in enumerate(per_host):
        for local_rank in range(count):
            having = [j for j, c in enumerate(per_host) if c > local_rank]
            specs.append(
                ProcessSpec(
                    rank=rank,
                    size=np,
                    host=hosts[hi].name,
                    host_index=hi,
                    local_rank=local_rank,
                    local_size=count,
                    cross_rank=having.index(hi),
                    cross_size=len(having),
                    argv=tuple(command),
                )
            )
            rank += 1
    return specs


def describe(specs: Sequence[ProcessSpec]) -> str:
    """``"4 ranks: host a ranks 0-1, host b ranks 2-3"`` for --verbose and error messages."""
    parts: dict[str, list[int]] = {}
    for s in specs:
        parts.setdefault(s.host, []).append(s.rank)
    shown = ", ".join(
        f"{h} rank{'s' if len(r) > 1 else ''} {r[0]}{f'-{r[-1]}' if len(r) > 1 else ''}"
        for h, r in parts.items()
    )
    return f"{len(specs)} rank{'s' if len(specs) != 1 else ''}: {shown}"
