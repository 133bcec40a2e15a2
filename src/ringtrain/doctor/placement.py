"""Rank placement check: how ``-np`` ranks land on the hosts, and what an uneven spread costs.

Ranks fill hosts in the order given, up to their slots (:func:`ringtrain.launch.plan.plan`), so
``-H a:4,b:3,c:1 -np 8`` runs 4-3-1. Data-parallel ranks move in lock-step, which makes an uneven
spread cost twice:

- **compute**: ranks on one host share its cores. With equal hosts, a rank on the 4-rank host
  gets a quarter of a host while the lone rank on the 1-rank host gets a whole one, and every
  rank waits for the slowest. The lock-step efficiency is ``n * min(cores_h / ranks_h) /
  sum(cores_h)``: the share of the hosts' cores that does useful work (1.0 when ranks are
  spread in proportion to cores). This assumes compute-bound ranks that scale with cores.
- **network**: the hierarchical allreduce sends ``2 (H-1)/H`` times the gradients across from
  every host, split over that host's ranks, so the lone rank of a 1-rank host carries 4x what
  a rank of a 4-rank host carries; a flat ring crosses each host boundary once per host.

Pure: numbers in, a :class:`PlacementReport` out; tested without processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ringtrain.errors import LaunchError
from ringtrain.launch.hosts import Host
from ringtrain.launch.plan import plan

# Below this lock-step efficiency an uneven placement is worth a warning of its own cost.
EFFICIENCY_WARN = 0.95


@dataclass(frozen=True)
class PlacementReport:
    """What :func:`check` found; ``to_dict()`` is the ``--json`` form."""

    np: int
    ranks_per_host: dict[str, int]
    uneven: bool
    # max / min ranks per host (1.0 when even).
    imbalance: float
    # Share of the hosts' cores doing useful work in lock-step (see the module docstring).
    compute_efficiency: float
    # Hierarchical allreduce: bytes across hosts per rank, as a multiple of the smallest.
    cross_traffic_per_rank: dict[str, float]
    # The most even placement the slots allow, and its efficiency; None when already even.
    even_alternative: dict[str, int] | None = None
    even_efficiency: float | None = None
    # -np values that put the same number of ranks on every host, within the slots.
    even_np: tuple[int, ...] = ()
    warnings: list[str] = field(default_factory=list)

    def pattern(self) -> str:
        """``"4-3-1"``."""
        return "-".join(str(c) for c in self.ranks_per_host.values())

    def to_dict(self) -> dict[str, object]:
        return {
            "np": self.np,
            "ranks_per_host": dict(self.ranks_per_host),
            "pattern": self.pattern(),
            "uneven": self.uneven,
            "imbalance": self.imbalance,
            "compute_efficiency": self.compute_efficiency,
            "cross_traffic_per_rank": dict(self.cross_traffic_per_rank),
            "even_alternative": self.even_alternative,
            "even_efficiency": self.even_efficiency,
            "even_np": list(self.even_np),
            "warnings": list(self.warnings),
        }


def ranks_per_host(np: int, hosts: Sequence[Host]) -> dict[str, int]:
    """Ranks per host, in host order, as the launcher places them (hosts left empty dropped).

    Raises :class:`LaunchError` when ``np`` exceeds the slots, with the launcher's message.
    """
    counts: dict[str, int] = {}
    for spec in plan(np, hosts, ("true",)):
        counts[spec.host] = counts.get(spec.host, 0) + 1
    return counts


def compute_efficiency(counts: Mapping[str, int], cores: Mapping[str, int] | None = None) -> float:
    """Lock-step share of the hosts' cores doing useful work (1.0: balanced).

    ``cores`` maps a host to its core count; hosts it does not name count as equal to the
    others (all 1 when it is empty), which is what a homogeneous cluster is.
    """
    used = {h: n for h, n in counts.items() if n > 0}
    if not used:
        return 1.0
    known = [c for h, c in (cores or {}).items() if h in used and c > 0]
    default = max(known) if known else 1
    per_host = {h: float((cores or {}).get(h) or default) for h in used}
    total_ranks = sum(used.values())
    slowest = min(per_host[h] / n for h, n in used.items())
    return min(1.0, total_ranks * slowest / sum(per_host.values()))


def even_placement(np: int, hosts: Sequence[Host]) -> dict[str, int]:
    """The most even spread of ``np`` ranks over ``hosts`` within their slots (host order kept).

    Ranks go one at a time to the host with the fewest so far that has a slot left; ties go to
    the host listed first. Raises :class:`LaunchError` when ``np`` exceeds the slots.
    """
    capacity = sum(h.slots for h in hosts)
    if np > capacity:
        ranks_per_host(np, hosts)  # raises the launcher's own message
    counts = {h.name: 0 for h in hosts}
    for _ in range(np):
        free = [h for h in hosts if counts[h.name] < h.slots]
        pick = min(free, key=lambda h: counts[h.name])
        counts[pick.name] += 1
    return {h: c for h, c in counts.items() if c > 0}


def _even_np(np: int, hosts: Sequence[Host]) -> tuple[int, ...]:
    """-np values near ``np`` that give every host the same count within the slots: the
    largest below ``np`` and the smallest above it."""
    if not hosts:
        return ()
    most = min(h.slots for h in hosts)
    per_host = range(1, most + 1)
    below = [k * len(hosts) for k in per_host if k * len(hosts) < np]
    above = [k * len(hosts) for k in per_host if k * len(hosts) > np]
    return tuple([*below[-1:], *above[:1]])


def _unbounded_even(np: int, hosts: Sequence[Host]) -> dict[str, int]:
    """The even spread of ``np`` over ``hosts`` if slots were no limit."""
    return even_placement(np, [Host(h.name, np) for h in hosts])


def _spec(counts: Mapping[str, int]) -> str:
    return ",".join(f"{h}:{c}" for h, c in counts.items())


def check(
    np: int, hosts: Sequence[Host], cores: Mapping[str, int] | None = None
) -> PlacementReport:
    """Where ``np`` ranks go on ``hosts``, whether that is even, and what it costs.

    ``cores`` (host -> cores usable by ranks) refines the compute cost; without it hosts are
    taken as equal. Raises :class:`LaunchError` when ``np`` exceeds the slots.
    """
    if np < 1:
        raise LaunchError(f"-np must be at least 1, got {np}")
    counts = ranks_per_host(np, hosts)
    lo, hi = min(counts.values()), max(counts.values())
    uneven = lo != hi
    efficiency = compute_efficiency(counts, cores)
    # Hierarchical allreduce: each host sends the same bytes across, split over its ranks.
    cross = {h: hi / c for h, c in counts.items()} if len(counts) > 1 else {h: 1.0 for h in counts}
    warnings: list[str] = []
    alternative: dict[str, int] | None = None
    alt_eff: float | None = None
    even_np: tuple[int, ...] = ()
    if uneven:
        alt = even_placement(np, hosts)
        alt_eff = compute_efficiency(alt, cores)
        alternative = alt if alt != counts else None
        even_np = tuple(n for n in _even_np(np, hosts) if n != np)
        lone = min(counts, key=lambda h: counts[h])
        busy = max(counts, key=lambda h: counts[h])
        lines = [
            f"uneven placement {'-'.join(str(c) for c in counts.values())} for -np {np} "
            f"({', '.join(f'{h} {c}' for h, c in counts.items())}): {hi / lo:.1f}x more ranks "
            f"on {busy} than on {lone}."
        ]
        cost = [
            f"ranks on {busy} share its cores {counts[busy]} ways, so in lock-step about "
            f"{efficiency:.0%} of the hosts' cores do useful work"
        ]
        if len(counts) > 1:
            cost.append(
                f"with hierarchical allreduce the rank on {lone} carries {cross[lone]:.1f}x the "
                f"cross-host traffic of a rank on {busy}"
            )
        lines.append("Cost: " + "; ".join(cost) + ".")
        fixes = []
        if alternative is not None:
            fixes.append(f"an even spread -H {_spec(alternative)} ({alt_eff:.0%} of cores useful)")
        if even_np:
            fixes.append(" or ".join(f"-np {n} ({n // len(hosts)} per host)" for n in even_np))
        if alternative is None:
            wider = _unbounded_even(np, hosts)
            fixes.append(f"more slots where they are short: -H {_spec(wider)}")
        hint = "HINT: use " + (
            " or ".join(fixes) if fixes else "the same number of ranks on every host"
        )
        hint += "; keep hierarchical allreduce on (auto) so each host's link is used once."
        lines.append(hint)
        warnings.append("\n".join(lines))
    idle = [h.name for h in hosts if h.name not in counts]
    if idle:
        warnings.append(
            f"-np {np} fills {', '.join(counts)} and leaves {', '.join(idle)} without ranks.\n"
            f"HINT: to use every host, spread the ranks: -H {_spec(even_placement(np, hosts))}."
        )
    if cores:
        for h, c in counts.items():
            have = cores.get(h)
            if have and c > have:
                warnings.append(
                    f"host {h} runs {c} ranks on {have} cores: ranks will time-share cores.\n"
                    f"HINT: give {h} at most {have} slots (-H {h}:{have})."
                )
    return PlacementReport(
        np=np,
        ranks_per_host=counts,
        uneven=uneven,
        imbalance=hi / lo,
        compute_efficiency=efficiency,
        cross_traffic_per_rank=cross,
        even_alternative=alternative,
        even_efficiency=alt_eff if alternative is not None else None,
        even_np=even_np,
        warnings=warnings,
    )
