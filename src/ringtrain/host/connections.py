"""The connections and files a rank holds at N ranks, computed from the groups ringtrain makes
and the peers each Gloo algorithm it uses talks to (issue 38 item 4).

What holds them, read from torch 2.13's ``ProcessGroupGloo`` and Gloo's sources (the TCP
transport, ``allreduce.cc``, ``allgather.cc``, ``broadcast.cc``, ``barrier.cc``,
``alltoall.cc``, ``gather.cc``):

* Every Gloo process group makes its own TCP device: a listening socket, an epoll instance and
  a wake-up pipe (:data:`FILES_PER_GLOO_GROUP` descriptors), and, once connected, one socket
  per peer it talks to. Two groups of the same ranks never share a connection.
* ringtrain sets ``TORCH_GLOO_LAZY_INIT`` (runtime/state.py): a group connects a pair at its
  first exchange, reading the peer's address from the store then (one read per peer), and at
  start only writes its own address (one write per group). Eagerly, every group would read all
  N addresses at start and connect N - 1 sockets.
* The peers of one rank by algorithm (:class:`Pattern`): the ring of allreduce, allgather(v)
  and reduce talks to rank - 1 and rank + 1; broadcast is a binomial tree from its root (over
  every root: rank +- 2^i); barrier is a dissemination (rank +- 2^i); alltoall(v),
  gather and scatter at their root, and ringtrain's direct rounds talk to every other rank.
* Groups of a process set are made by its members only: the others get
  ``GroupMember.NON_GROUP_MEMBER`` before any device or store key is made, and no store barrier
  runs (torch runs one only under ``TORCH_DIST_INIT_BARRIER=1``), so a set's start costs its
  members one store write per group and nobody else anything. ``new_group``'s
  ``use_local_synchronization=True`` would save nothing more, and is unsafe here: the group's
  store prefix is then a hash of its ranks and of how many groups *this* rank has registered,
  while non-members register none, so two members of a set whose earlier sets differ (``[0,
  1]`` then ``[1, 2]``: rank 1 counts four groups more than rank 2) look for each other under
  different prefixes and hang at their first exchange.

:data:`TRAFFIC` names what ringtrain sends on which group with which pattern (the code it
reads from is named in each entry); :func:`footprint` sums them for a job. The model is
checked against the sockets and listeners measured at 4 ranks (tests/runtime/test_sockets.py)
and its figures at 8 to 1,024 ranks are pinned in tests/host/test_connections.py. Plain Python:
the launcher's agent asks it how many files a rank may need (:mod:`ringtrain.host.open_files`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ringtrain.config import Config

# The Gloo groups a communicator makes for every process set, the world included
# (runtime/communicator.py creates exactly these, from this tuple).
GROUP_KINDS: tuple[str, ...] = ("control", "cpu", "engine", "lane")
# The world's default group (init_process_group), beside the world set's own groups.
DEFAULT_GROUP = "default"
# A Gloo TCP device: its listening socket, its epoll instance and the two ends of its wake-up pipe.
FILES_PER_GLOO_GROUP = 4
# Sockets a rank holds to the rendezvous store as a client: the job's TCPStore connection, and
# one per process set (the world's included) whose controller has dozed once: an idle
# controller blocks on a store key over a connection of its own (collectives/doorbell.py).
STORE_CLIENT_SOCKETS = 1
STORE_SOCKETS_PER_DOZING_SET = 1
# A rank's door: a socket it listens on and never accepts from, whose refusal tells a peer on
# another machine that the rank's process ended (runtime/processes.py).
DOORS = 1


class Pattern(enum.Enum):
    """Which peers one rank talks to in a Gloo algorithm."""

    RING = "ring"  # allreduce, allgather(v), reduce: rank - 1 and rank + 1
    TREE = "tree"  # broadcast: its binomial tree, for every root a job may use
    DISSEMINATION = "dissemination"  # barrier: rank +- 2^i
    DOUBLING = "doubling"  # vector rounds: rank ^ 2^i, on 2-rank groups (doubling_steps)
    ALL = "all"  # alltoall(v), gather/scatter at the root, direct rounds: every other rank


def _tree(rank: int, size: int, root: int) -> set[int]:
    """The peers of ``rank`` in Gloo's broadcast from ``root`` (broadcast.cc): in step i the
    virtual ranks below 2^(i+1) pair with the one whose bit i differs."""
    vrank = (rank - root) % size
    dim = (size - 1).bit_length()
    out = set()
    for i in range(dim):
        if vrank >> (i + 1):
            continue
        vpeer = vrank ^ (1 << i)
        if vpeer < size:
            out.add((vpeer + root) % size)
    return out


def doubling_pairs(size: int) -> list[tuple[int, int]]:
    """Every 2-rank group of a recursive-doubling reduction over ``size`` ranks, in the order
    each rank of the world creates them (torch wants every rank to call ``new_group`` for every
    group, in one order). Of p, the largest power of two up to ``size``: rank r >= p folds into
    r - p first; ranks below p pair with r ^ 2^i, i = 0 .. log2 p - 1."""
    p = 1 << (size.bit_length() - 1) if size > 0 else 0
    pairs = [(r - p, r) for r in range(p, size)]
    level = 1
    while level < p:
        pairs += [(r, r ^ level) for r in range(p) if r < r ^ level]
        level <<= 1
    return pairs


def doubling_steps(rank: int, size: int) -> list[tuple[int, int]]:
    """The pairs ``rank`` reduces with, step by step: ranks p and up fold into r - p, wait while
    the others double, and take the result back over the same pair (the AND of the result with
    what they hold is the result); ranks below p fold (if they have a partner above p), double,
    and send the result back. log2 p steps, plus 2 where ``size`` is not a power of two."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    p = 1 << (size.bit_length() - 1)
    if rank >= p:
        return [(rank - p, rank), (rank - p, rank)]
    fold = [(rank, rank + p)] if rank + p < size else []
    steps = [tuple(sorted((rank, rank ^ (1 << i)))) for i in range(p.bit_length() - 1)]
    return fold + [(a, b) for a, b in steps] + fold


def peers(pattern: Pattern, rank: int, size: int) -> frozenset[int]:
    """The ranks that ``rank`` connects to in a group of ``size`` over ``pattern``."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    if pattern is Pattern.RING:
        out = {(rank - 1) % size, (rank + 1) % size}
    elif pattern is Pattern.TREE:
        out = set().union(*(_tree(rank, size, root) for root in range(size)))
    elif pattern is Pattern.DOUBLING:
        out = {b if a == rank else a for a, b in doubling_steps(rank, size)}
    elif pattern is Pattern.DISSEMINATION:
        steps = [1 << i for i in range((size - 1).bit_length())]
        out = {(rank + d) % size for d in steps} | {(rank - d) % size for d in steps}
    else:
        out = set(range(size))
    out.discard(rank)
    return frozenset(out)


@dataclass(frozen=True)
class Traffic:
    """One kind of message ringtrain sends: on which group, over which pattern, from where."""

    group: str
    pattern: Pattern
    what: str


# What ringtrain sends on its groups (each entry names the code it was read from). A job uses
# some of them; :data:`PROFILES` names the usual mixes.
TRAFFIC: dict[str, Traffic] = {
    "negotiation": Traffic(
        "control",
        Pattern.RING,
        "negotiation rounds: the slots' allgather (collectives/control_round.py); the "
        "topology's all_gather_object at start. Vector rounds (vector_round.py) reduce on "
        "2-rank groups of their own, from Config.vector_rounds_from ranks: see footprint",
    ),
    "ring": Traffic(
        "cpu",
        Pattern.RING,
        "allreduces on Gloo's ring (above ordered.ALONE_ABOVE_BYTES, integers, Min/Max, 2 "
        "ranks, reproducible off: collectives/execute.py), allgather, the small ops a vector "
        "round gathers",
    ),
    "rank_order": Traffic(
        "cpu",
        Pattern.ALL,
        "floating-point sums fused in rank order from 3 ranks (collectives/ordered.py: two "
        "all_to_all_single), the default for allreduces up to 1 MiB",
    ),
    "broadcast": Traffic("cpu", Pattern.TREE, "broadcast (collectives/unfused.py)"),
    "alltoall": Traffic("cpu", Pattern.ALL, "alltoall (collectives/unfused.py)"),
    "lane_ring": Traffic(
        "lane",
        Pattern.RING,
        "the fast lane's allreduce on the ring (collectives/lane.py), from 3 ranks above 1 MiB "
        "after a one-value agreement on the claims (collectives/agreed.py)",
    ),
    "lane_rank_order": Traffic(
        "lane",
        Pattern.ALL,
        "the fast lane's sums in rank order from 3 ranks, up to 1 MiB (collectives/lane.py)",
    ),
    "optimizer": Traffic(
        "engine",
        Pattern.RING,
        "DistributedOptimizer's summed buckets and agreements (transport.allreduce)",
    ),
    "optimizer_direct": Traffic(
        "engine",
        Pattern.ALL,
        "the Ring transport's direct rounds: a reduce-scatter or allgather whose n - 1 "
        "pieces fit in 1 MiB goes straight to every rank (transport/ring.py: sharded "
        "steps, compressed exchanges)",
    ),
}

# The usual mixes. "horovod" is a job on the defaults (reproducible): Horovod's allreduce,
# broadcast and DistributedOptimizer; "rings" the same with RINGTRAIN_REPRODUCIBLE=0 (or
# allreduces above 1 MiB only); "horovod+direct" adds the optimizer's direct rounds.
PROFILES: dict[str, tuple[str, ...]] = {
    "rings": ("negotiation", "ring", "broadcast", "lane_ring", "optimizer"),
    "horovod": ("negotiation", "ring", "rank_order", "broadcast", "lane_rank_order", "optimizer"),
    "horovod+direct": (
        "negotiation",
        "ring",
        "rank_order",
        "broadcast",
        "alltoall",
        "lane_rank_order",
        "optimizer",
        "optimizer_direct",
    ),
}


@dataclass(frozen=True)
class Footprint:
    """What one rank holds, computed (see the module docstring)."""

    size: int
    gloo_groups: int  # groups this rank is a member of, the default group included
    gloo_sockets: int  # one per (group, peer) this rank exchanges with
    store_sockets: int
    # The store at start: lazily, one write per group and no read; eagerly, every group would
    # read every member's address. Each Gloo socket costs one read at its first exchange.
    store_writes_at_start: int
    store_reads_at_start: int
    store_reads_eager: int
    by_group: tuple[tuple[str, int], ...]  # (group, sockets), for the world's groups

    @property
    def sockets(self) -> int:
        """Established TCP connections: Gloo's peers and the store."""
        return self.gloo_sockets + self.store_sockets

    @property
    def listeners(self) -> int:
        """Listening sockets: each Gloo group's and the rank's door."""
        return self.gloo_groups + DOORS

    @property
    def files(self) -> int:
        """Descriptors for them: the sockets, each group's listener, epoll and pipe, the door."""
        return self.sockets + FILES_PER_GLOO_GROUP * self.gloo_groups + DOORS


def _group_sockets(uses: Iterable[str], rank: int, size: int) -> dict[str, int]:
    by_group: dict[str, set[int]] = {kind: set() for kind in (DEFAULT_GROUP, *GROUP_KINDS)}
    for name in uses:
        if name not in TRAFFIC:
            raise ValueError(f"unknown traffic {name!r}; known: {', '.join(TRAFFIC)}")
        t = TRAFFIC[name]
        by_group[t.group] |= peers(t.pattern, rank, size) if size > 1 else set()
    return {kind: len(p) for kind, p in by_group.items()}


def footprint(
    size: int,
    uses: Iterable[str],
    *,
    rank: int = 0,
    process_sets: Sequence[tuple[int, Iterable[str]]] = (),
    engine_streams: int = 1,
    serves_store: bool = False,
    dozed: bool = True,
    config: Config | None = None,
) -> Footprint:
    """What ``rank`` of a world of ``size`` holds once a job used ``uses`` (names in
    :data:`TRAFFIC`, or a profile's). ``process_sets``: (size, traffic used) of each other set
    this rank is a member of; ``engine_streams``: the engine's groups (each a ring,
    Config.engine_streams); ``serves_store``: this rank serves the rendezvous store (rank 0
    under torchrun: one more socket per rank), not ``ringtrain run``'s store process;
    ``dozed``: every set's controller has dozed once (a job's steady state: any idle second);
    ``config``: the settings that decide which sets have vector rounds' 2-rank groups (one per
    recursive-doubling partner, connected once "negotiation" ran), the defaults if None."""
    if size < 1:
        raise ValueError(f"a world has at least 1 rank, got {size}")
    uses = tuple(uses)
    world = _group_sockets(uses, rank, size)
    extra = engine_streams - 1
    gloo = sum(world.values()) + extra * (len(peers(Pattern.RING, rank, size)) if size > 1 else 0)
    groups = 1 + len(GROUP_KINDS) + extra
    pairs = _pair_groups(config or Config(), size, rank)
    groups += pairs
    world["pairs"] = pairs if "negotiation" in uses else 0
    gloo += world["pairs"]
    for members, used in process_sets:
        set_uses = tuple(used)
        set_pairs = _pair_groups(config or Config(), members, 0)
        gloo += sum(_group_sockets(set_uses, 0, members).values())
        gloo += set_pairs if "negotiation" in set_uses else 0
        groups += len(GROUP_KINDS) + set_pairs
    dozing = sum(n > 1 for n in (size, *(members for members, _ in process_sets)))  # lone: never
    store = STORE_CLIENT_SOCKETS + (size if serves_store else 0)
    store += STORE_SOCKETS_PER_DOZING_SET * dozing if dozed else 0
    return Footprint(
        size=size,
        gloo_groups=groups,
        gloo_sockets=gloo,
        store_sockets=store,
        store_writes_at_start=groups,
        store_reads_at_start=0,
        store_reads_eager=groups * size,
        by_group=tuple(world.items()),
    )


def _pair_groups(config: Config, size: int, rank: int) -> int:
    """The vector rounds' 2-rank groups ``rank`` of a set of ``size`` belongs to: one per
    recursive-doubling partner (runtime/communicator.py makes them)."""
    if not config.vector_rounds_at(size):
        return 0
    return len(peers(Pattern.DOUBLING, rank, size))


def most_files(size: int) -> int:
    """The most descriptors ringtrain's connections may take on one rank of ``size``: every
    traffic of :data:`TRAFFIC` (so the cpu, lane and engine groups connect every pair)."""
    return footprint(size, TRAFFIC).files
