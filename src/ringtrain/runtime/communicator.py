"""The torch.distributed process groups that serve one process set.

Each set gets its own groups so that traffic of different sets, and of the control plane and the
data plane, never interleaves on one connection:

* ``control``: Gloo, carries the small negotiation messages of the collectives controller;
* ``cpu``: Gloo, carries CPU tensors;
* ``cuda``: carries CUDA tensors: NCCL where CUDA and NCCL are available and every rank of the
  set has its own GPU, else the ``cpu`` group, which moves them through host memory (decided at
  the set's first CUDA collective, see :mod:`ringtrain.runtime.devices`);
* ``engine``: Gloo, carries the gradient buckets of DistributedOptimizer, whose order is fixed by
  the engine itself and so needs no negotiation;
* ``lane``: Gloo, carries the controller's fast lane (allreduces that repeat a reserved request
  and so skip the negotiation round, see :mod:`ringtrain.collectives.lane`).

Layers above attach services (the controller) with :meth:`attach`; they are closed before the
groups are destroyed.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ringtrain.host.connections import GROUP_KINDS, doubling_pairs, doubling_steps
from ringtrain.runtime import devices
from ringtrain.runtime.contracts import Group, Store
from ringtrain.security.notes import PLAIN, Notes

log = logging.getLogger("ringtrain")


class Closable(Protocol):
    def close(self) -> None: ...


class Communicator:
    """Process groups and attached services of one process set, seen from this rank."""

    def __init__(
        self,
        set_id: int,
        ranks: Sequence[int],
        world_rank: int,
        groups: dict[str, dist.ProcessGroup],
        is_world: bool,
        store: Store | None = None,
        host: str = "",
        notes: Notes = PLAIN,
    ) -> None:
        self.set_id = set_id
        self.ranks = tuple(ranks)
        self.world_rank = world_rank
        # Looked up once: every collective asks, and a scan of the ranks grows with the set.
        self._set_rank = self.ranks.index(world_rank) if world_rank in self.ranks else -1
        self.is_world = is_world
        # The job's rendezvous store (None at world size 1): idle controllers wait on it.
        self.store = store
        # Seals the store values that carry a user's words, in secure mode (security/notes.py).
        self.notes = notes
        self.host = host or socket.gethostname()
        self._groups = groups
        self._services: dict[str, Closable] = {}
        # Where CUDA tensors go, once decided (see cuda_route); "cuda" in groups once decided.
        self.cuda_route: devices.CudaRoute | None = None
        self._route_lock = threading.Lock()

    @property
    def included(self) -> bool:
        return self._set_rank >= 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def set_rank(self) -> int:
        if not self.included:
            from ringtrain.errors import CollectiveArgumentError

            raise CollectiveArgumentError(
                f"rank {self.world_rank} is not a member of process set {self.set_id} "
                f"(ranks {list(self.ranks)})"
            )
        return self._set_rank

    # The Group protocol, not ProcessGroup: what the layers above call on it is its rank and
    # size; torch's collectives take it as it is (runtime.contracts).
    def group(self, kind: str) -> Group:
        """The process group of ``kind`` ('control', 'cpu', 'cuda', 'engine'). CUDA tensors
        take :meth:`group_for`, which decides between NCCL and host memory first."""
        if kind == "cuda" and "cuda" not in self._groups and "nccl" not in self._groups:
            from ringtrain.errors import CollectiveArgumentError

            raise CollectiveArgumentError(
                "a CUDA tensor was given, but no NCCL process group exists.\n"
                "HINT: CUDA collectives need a CUDA build of torch with NCCL and a GPU on every "
                "rank at ringtrain.init(); move the tensor to the CPU otherwise."
            )
        if kind == "cuda" and "cuda" not in self._groups:
            return self._groups["nccl"]  # not decided yet: group_for decides with a tensor
        return self._groups[kind]

    def optional_group(self, kind: str) -> dist.ProcessGroup | None:
        """The process group of ``kind``, or None where this set has none."""
        return self._groups.get(kind)

    def group_for(self, tensor: torch.Tensor) -> dist.ProcessGroup:
        """The group that carries ``tensor``. Collective at the set's first CUDA tensor: the
        executor calls it for the same op at the same point on every rank of the set."""
        if not tensor.is_cuda:
            return self._groups["cpu"]
        if "cuda" not in self._groups:
            self.group("cuda")  # raises if this set has no NCCL group either
            self._route_cuda(tensor.device)
        return self._groups["cuda"]

    def _route_cuda(self, device: torch.device) -> None:
        """Decide where this set's CUDA tensors travel (see :mod:`ringtrain.runtime.devices`):
        every rank reports the device of the first CUDA collective's tensors; NCCL unless two
        ranks share one, else the ``cpu`` (Gloo) group, which stages them in host memory."""
        with self._route_lock:
            if "cuda" in self._groups:
                return
            route = devices.CudaRoute(True)
            if self.size > 1:
                mine = devices.identity(device, self.host)
                every: list[Any] = [None] * self.size
                dist.all_gather_object(every, mine, group=self._groups["cpu"])
                route = devices.choose_route(every, self.ranks, self.set_id)
            if not route.nccl:
                # One warning per set, from its first rank; the others say it at DEBUG.
                level = logging.WARNING if self.set_rank == 0 else logging.DEBUG
                log.log(level, "%s", route.reason)
            self.cuda_route = route
            self._groups["cuda"] = self._groups["nccl" if route.nccl else "cpu"]

    def pair_groups(self) -> list[Any]:
        """This rank's 2-rank groups in the order of its recursive-doubling steps
        (:func:`~ringtrain.host.connections.doubling_steps`); empty where the set made none."""
        if not any(kind.startswith(_PAIR) for kind in self._groups):
            return []
        steps = doubling_steps(self.set_rank, self.size)
        return [self._groups[_pair_kind(a, b)] for a, b in steps]

    def global_rank(self, set_rank: int) -> int:
        return self.ranks[set_rank]

    def attach(self, name: str, service: Closable) -> None:
        self._services[name] = service

    def service(self, name: str) -> Any:
        return self._services.get(name)

    def close(self, destroy_groups: bool | None = None) -> None:
        """Close attached services, then destroy this set's groups. ``destroy_groups``: by
        default only those of sets other than the world, whose groups die with the default
        group (which an adopted default group does not: see :mod:`ringtrain.runtime.state`)."""
        for service in reversed(list(self._services.values())):
            service.close()
        self._services.clear()
        if not self.is_world if destroy_groups is None else destroy_groups:
            for g in {id(g): g for g in self._groups.values()}.values():
                if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)
        self._groups.clear()


_PAIR = "pair:"


def _pair_kind(a: int, b: int) -> str:
    return f"{_PAIR}{a}-{b}"


def create(
    set_id: int,
    ranks: Sequence[int],
    world_rank: int,
    world_size: int,
    timeout_s: float,
    backend: str = "gloo",
    store: Store | None = None,
    host: str = "",
    pairs: bool = False,
    notes: Notes = PLAIN,
) -> Communicator:
    """Create the groups of a process set. Collective: every world rank calls it in the same order.

    ``pairs``: also the 2-rank groups a vector round reduces over in log2 steps
    (:mod:`ringtrain.collectives.vector_round`), from ``Config.vector_rounds_at``. Every world
    rank makes every pair, as every group; a rank holds log2 N of them (connected lazily).

    ``backend``: that of the default group. Other than ``gloo`` (``ringtrain_sealed``, see
    :mod:`ringtrain.transport.sealed_backend`, or ``ringtrain_tcp``, see
    :mod:`ringtrain.transport.tcp_backend`), every group uses it, so callers use them as any
    other group; CUDA tensors then travel through host memory (NCCL cannot seal, and an enclave
    job makes no NCCL group). With Gloo, the NCCL group is made here (it connects lazily, at its
    first collective) and used only if no two ranks of the set share a GPU; ``host``: this rank's
    host, for that check (see :mod:`ringtrain.runtime.devices`). ``notes``: seals what the set's
    services post in ``store`` that carries a user's words (secure mode).
    """
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    is_world = list(ranks) == list(range(world_size))
    groups: dict[str, dist.ProcessGroup] = {}
    # The kinds come from the connection model's table (host/connections.py), so the sockets
    # it computes are those of the groups made here. Every world rank calls new_group, members
    # or not (see ringtrain.host.connections for why not use_local_synchronization).
    for kind in GROUP_KINDS:
        groups[kind] = dist.new_group(
            list(ranks), timeout=timeout, backend=backend, use_local_synchronization=False
        )
    if pairs and len(ranks) > 1:
        members = list(ranks)
        for a, b in doubling_pairs(len(members)):
            pair = dist.new_group(
                [members[a], members[b]],
                timeout=timeout,
                backend=backend,
                use_local_synchronization=False,
            )
            if pair is not dist.GroupMember.NON_GROUP_MEMBER:  # kept by its two members only
                groups[_pair_kind(a, b)] = pair
    if backend != "gloo":
        groups["cuda"] = groups["cpu"]
    elif torch.cuda.is_available() and dist.is_nccl_available():
        groups["nccl"] = dist.new_group(list(ranks), timeout=timeout, backend="nccl")
    return Communicator(set_id, ranks, world_rank, groups, is_world, store, host, notes)
