"""Hierarchical (2D) allreduce: reduce within each host, across hosts on shards, then share.

Three phases, each over its own process groups:

1. **reduce-scatter within each host**: a host with s ranks splits the tensor into s chunks and
   each local rank ends with the host's sum of one chunk;
2. **allreduce across hosts**, shard by shard: one rank per host, each holding the same element
   range, sum it over the hosts;
3. **allgather within each host**: every rank gets the whole result.

Only phase 2 crosses hosts, and each host sends about 2 (H-1)/H times the tensor once, whatever
the rank order: a flat ring in a round-robin order (a, b, a, b, ...) crosses hosts on every hop.

**Uneven placements (4-3-1).** Hosts with different rank counts cut the tensor at different
points: a 4-rank host at 1/4, 1/2, 3/4 and a 3-rank host at 1/3, 2/3. The cuts of all hosts
together split [0, 1) into *segments* (here 6); in each segment every host has exactly one owner
(the local rank whose chunk contains it), and the owners of a segment, one per host, form that
segment's cross-host group. Owners allreduce their segments in segment order, which cannot
deadlock: the lowest pending segment's owners all reach it first. A host with one rank owns
every segment, so it sends its whole tensor across once, as it must. Cuts are fractions, and
element boundaries are ``numel * i // s``, so the plan, and the groups, depend only on the
placement, never on the tensor: groups are built once, in :class:`HierarchicalAllreduce`.

:func:`plan` and :func:`cross_host_bytes` are pure, so placement questions ("how many bytes cross
hosts in a round-robin 4x2 job?") are answered without processes.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import compat
from ringtrain.errors import CollectiveArgumentError, ConfigError

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # summed, then divided by the world size
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}


@dataclass(frozen=True)
class Segment:
    """An element range, as fractions of the tensor, and its owner on every host."""

    start: Fraction
    end: Fraction
    owners: tuple[int, ...]  # global ranks, one per host, in host order

    def bounds(self, numel: int) -> tuple[int, int]:
        return _cut(numel, self.start), _cut(numel, self.end)


@dataclass(frozen=True)
class HostPlan:
    """The groups and segments of a hierarchical allreduce for one placement."""

    host_of_rank: tuple[Hashable, ...]
    hosts: tuple[tuple[int, ...], ...]  # ranks of each host, hosts in order of their lowest rank
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return len(self.host_of_rank)

    def host_index(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.hosts) if rank in ranks)

    def cross_groups(self) -> list[tuple[int, ...]]:
        """Distinct owner sets of more than one rank, in segment order."""
        return list(dict.fromkeys(s.owners for s in self.segments if len(s.owners) > 1))

    def chunk_bounds(self, rank: int, numel: int) -> tuple[int, int]:
        """The element range ``rank`` reduces on its host in phase 1."""
        local = self.hosts[self.host_index(rank)]
        j, s = local.index(rank), len(local)
        return _cut(numel, Fraction(j, s)), _cut(numel, Fraction(j + 1, s))


def _cut(numel: int, f: Fraction) -> int:
    # floor(numel * f): equal fractions (1/2, 2/4) give equal cuts, so hosts agree on boundaries.
    return numel * f.numerator // f.denominator


def plan(host_of_rank: Sequence[Hashable]) -> HostPlan:
    """The hierarchical plan for ranks placed on ``host_of_rank[r]`` (any hashable host id)."""
    if not host_of_rank:
        raise ConfigError("hierarchical allreduce needs at least one rank in host_of_rank")
    order = list(dict.fromkeys(host_of_rank))
    hosts = tuple(tuple(r for r, h in enumerate(host_of_rank) if h == host) for host in order)
    cuts = sorted({Fraction(i, len(local)) for local in hosts for i in range(len(local) + 1)})
    segments = []
    for start, end in itertools.pairwise(cuts):
        # Owner on each host: the local rank j whose chunk [j/s, (j+1)/s) contains `start`.
        owners = tuple(local[int(start * len(local))] for local in hosts)
        segments.append(Segment(start, end, owners))
    return HostPlan(tuple(host_of_rank), hosts, tuple(segments))


@dataclass(frozen=True)
class Traffic:
    """Bytes that cross hosts for one allreduce, in total and sent by each host."""

    total_bytes: int
    sent_by_host: tuple[int, ...]


def _ring_sends(numel: int, members: int) -> list[int]:
    """Elements each member of a ring allreduce sends (reduce-scatter + allgather phases).

    Member i sends every chunk but chunk (i+1) % m in each phase, with chunks cut at
    numel * c // m.
    """
    if members <= 1:
        return [0] * members
    sizes = [numel * (c + 1) // members - numel * c // members for c in range(members)]
    return [2 * (numel - sizes[(i + 1) % members]) for i in range(members)]


def cross_host_bytes(
    host_of_rank: Sequence[Hashable], numel: int, itemsize: int = 4, scheme: str = "hierarchical"
) -> Traffic:
    """Bytes crossing hosts for one allreduce of ``numel`` elements (pure; a model, not a trace).

    ``scheme="ring"``: one ring over all ranks in rank order (what a flat allreduce does; each hop
    between ranks on different hosts crosses). ``scheme="hierarchical"``: only the per-segment
    cross-host rings of :func:`plan` cross. Both assume ring allreduces (Gloo's and NCCL's
    algorithm for large tensors); intra-host traffic is not counted.
    """
    p = plan(host_of_rank)
    host = {r: i for i, ranks in enumerate(p.hosts) for r in ranks}
    sent = [0] * len(p.hosts)
    if scheme == "ring":
        n = p.size
        for r, elems in enumerate(_ring_sends(numel, n)):
            if host[r] != host[(r + 1) % n]:
                sent[host[r]] += elems * itemsize
    elif scheme == "hierarchical":
        for seg in p.segments:
            a, b = seg.bounds(numel)
            for owner, elems in zip(seg.owners, _ring_sends(b - a, len(seg.owners)), strict=True):
                sent[host[owner]] += elems * itemsize
    else:
        raise ConfigError(f"scheme must be 'ring' or 'hierarchical', got {scheme!r}")
    return Traffic(sum(sent), tuple(sent))


def prefer_hierarchical(host_of_rank: Sequence[Hashable], setting: str = "auto") -> bool:
    """Whether to use the hierarchical allreduce for this placement (pure).

    ``setting`` is ``Config.hierarchical``: "on" and "off" decide; "auto" chooses it when it
    sends fewer bytes across hosts than one ring in rank order, i.e. when there are several
    hosts and some host runs more than one rank (then the ring crosses hosts at least as often).
    """
    if setting not in ("auto", "on", "off"):
        raise ConfigError(
            f"hierarchical must be 'auto', 'on' or 'off', got {setting!r}\n"
            "HINT: 'auto' decides from the placement."
        )
    if setting != "auto":
        return setting == "on"
    numel = 1 << 20  # large enough that rounding of chunk sizes does not decide
    hier = cross_host_bytes(host_of_rank, numel).total_bytes
    return hier < cross_host_bytes(host_of_rank, numel, scheme="ring").total_bytes


class HierarchicalAllreduce:
    """Allreduce over the default process group, hierarchically, for a fixed placement.

    Construction is collective: every rank of the default group must build it with the same
    ``host_of_rank`` (indexed by global rank), in the same order relative to other group creation,
    because it creates the host and cross-host groups with ``torch.distributed.new_group``.
    Call :meth:`close` (or use it as a context manager) to destroy them.
    """

    def __init__(
        self,
        host_of_rank: Sequence[Hashable],
        backend: str = "gloo",
        timeout: datetime.timedelta | None = None,
    ) -> None:
        world = dist.get_world_size()
        if len(host_of_rank) != world:
            raise ConfigError(
                f"host_of_rank has {len(host_of_rank)} entries for a world of {world} ranks.\n"
                "HINT: give the host of every global rank, e.g. from ringtrain's topology."
            )
        self.plan = plan(host_of_rank)
        self.rank = dist.get_rank()
        self.world = world
        kw: dict[str, Any] = {"backend": backend}  # new_group's keywords
        if timeout is not None:
            kw["timeout"] = timeout
        # Every rank creates every group, in the same order (new_group is collective).
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for ranks in [h for h in self.plan.hosts if len(h) > 1] + self.plan.cross_groups():
            self._groups[ranks] = dist.new_group(list(ranks), **kw)
        self.local_ranks = self.plan.hosts[self.plan.host_index(self.rank)]

    def __enter__(self) -> HierarchicalAllreduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for ranks, g in self._groups.items():
            if self.rank in ranks:
                dist.destroy_process_group(g)
        self._groups.clear()

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks, in place; returns it. ``op``: sum, avg, min, max."""
        if op not in _OPS:
            raise CollectiveArgumentError(
                f"hierarchical allreduce supports ops {sorted(_OPS)}, got {op!r}"
            )
        if op == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise CollectiveArgumentError(
                f"op='avg' needs a floating-point tensor, got {tensor.dtype}.\n"
                "HINT: use op='sum' and divide yourself, or convert to float first."
            )
        if not tensor.is_contiguous():
            raise CollectiveArgumentError(
                "hierarchical allreduce works in place on a contiguous tensor.\n"
                "HINT: pass tensor.contiguous() and use the returned tensor."
            )
        flat = tensor.view(-1)
        numel = flat.numel()
        if numel == 0:
            return tensor
        rop = _OPS[op]
        s = len(self.local_ranks)
        local = self._groups.get(self.local_ranks)
        lo, hi = self.plan.chunk_bounds(self.rank, numel)
        width = -(-numel // s)  # the widest chunk; narrower ones are zero-padded

        # 1. reduce-scatter within the host (padded to equal chunks, as the collective needs).
        if local is not None:
            rows = torch.zeros(s, width, dtype=flat.dtype, device=flat.device)
            for j in range(s):
                a, b = numel * j // s, numel * (j + 1) // s
                rows[j, : b - a] = flat[a:b]
            mine = torch.empty(width, dtype=flat.dtype, device=flat.device)
            compat.reduce_scatter_single(mine, rows.view(-1), op=rop, group=local)
        else:
            mine = flat.clone()

        # 2. across hosts, one allreduce per segment this rank owns, in segment order.
        for seg in self.plan.segments:
            if self.rank not in seg.owners or len(seg.owners) == 1:
                continue
            a, b = seg.bounds(numel)
            if a == b:
                continue  # empty on every rank alike (same numel, same cuts)
            part = mine[a - lo : b - lo].clone()
            dist.all_reduce(part, op=rop, group=self._groups[seg.owners])
            mine[a - lo : b - lo] = part

        # 3. allgather within the host.
        if local is not None:
            gathered = torch.empty(s * width, dtype=flat.dtype, device=flat.device)
            compat.all_gather_single(gathered, mine, group=local)
            rows = gathered.view(s, width)
            for j in range(s):
                a, b = numel * j // s, numel * (j + 1) // s
                flat[a:b] = rows[j, : b - a]
        else:
            flat.copy_(mine[: hi - lo])
        if op == "avg":
            flat /= self.world
        return tensor
