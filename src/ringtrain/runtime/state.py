"""Initialization and shutdown: the one place that owns this process's distributed state.

``start()`` reads the launch environment, connects to the rendezvous store, creates the default
process group, measures the host placement, and creates the world's communicator. ``stop()``
undoes all of it, so ``start(); stop(); start()`` works again and again in one process: each
start uses a fresh key prefix ("generation") in the same store, and stores are kept for the
process's lifetime because a TCPStore server cannot be rebound reliably while peers reconnect.

A default process group that the script (or Ray Train, Lightning, Accelerate) created before
``start()`` is *adopted*: its rank and size are the job's, its store carries ringtrain's groups
(or, where it has no store, rank 0 serves one and tells the others through that group), and
ringtrain's groups are made beside it. ``stop()`` then destroys ringtrain's groups only: the
default group stays the script's, usable after ``shutdown()``, as Horovod leaves it.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import environ
from ringtrain.config import Config
from ringtrain.environ import Ringtrain, Threads, Torch
from ringtrain.errors import ConfigError, LaunchEnvironmentError, NotInitializedError
from ringtrain.host import cpu_limits, network
from ringtrain.runtime import (
    abandoned_groups,
    communicator,
    environment,
    exit_guard,
    forming_gather,
    rank_prefix,
    store_connect,
    topology,
)
from ringtrain.runtime.arrivals import world_store
from ringtrain.runtime.backends import GroupBackends
from ringtrain.runtime.contracts import Group
from ringtrain.runtime.environment import Placement
from ringtrain.runtime.process_sets import ProcessSet, global_process_set
from ringtrain.runtime.topology import Topology
from ringtrain.runtime.watched_store import WatchedStore
from ringtrain.security import keys
from ringtrain.security.notes import PLAIN, Notes

log = logging.getLogger("ringtrain")

WORLD_SET_ID = 0


@dataclass
class Runtime:
    """Everything ringtrain knows about the running job, on this rank."""

    config: Config
    placement: Placement
    topology: Topology
    rank: int
    size: int
    generation: int
    world: ProcessSet
    process_sets: dict[int, ProcessSet] = field(default_factory=dict)
    next_set_id: int = 1
    # The backend of ringtrain's groups ("gloo", or ringtrain's sealed or TCP backend).
    backend: str = "gloo"
    # True when the default group was the script's (see the module docstring): stop keeps it.
    adopted: bool = False

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank(self.rank)

    @property
    def local_size(self) -> int:
        return self.topology.local_size(self.rank)

    @property
    def cross_rank(self) -> int:
        return self.topology.cross_rank(self.rank)

    @property
    def cross_size(self) -> int:
        return self.topology.cross_size(self.rank)


_lock = threading.RLock()
_runtime: Runtime | None = None
_generation = 0
_stores: dict[tuple[str, int, bool], dist.TCPStore] = {}
_backends: GroupBackends | None = None  # the running job's, to release at stop/abandon


def current() -> Runtime:
    """The running job; raises :class:`NotInitializedError` before ``start()``."""
    if _runtime is None:
        raise NotInitializedError()
    return _runtime


def is_initialized() -> bool:
    return _runtime is not None


def _configure_logging(level: str) -> None:
    logger = logging.getLogger("ringtrain")
    logger.setLevel(level.upper())
    # Python's last-resort handler prints warnings only: below that, ringtrain's records (the
    # tuning that -v promises) need a handler, unless the script configured logging itself.
    if logger.level < logging.WARNING and not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def start(
    config: Config | None = None,
    env: Mapping[str, str] | None = None,
    *,
    backends: GroupBackends,
    rank: int | None = None,
    size: int | None = None,
    elastic: tuple[int, int, int] | None = None,
    superseded: Callable[[], bool] | None = None,
) -> Runtime:
    """Join the job described by the environment. Idempotent while already initialized.

    ``elastic``: ``(rank, size, generation)`` of a world the launcher announced (see
    :mod:`ringtrain.runtime.membership`); the store prefix then comes from the launcher's
    generation, so survivors agree on it whatever each one did before. ``backends``: the
    process-group backends to choose from (``lifecycle`` passes ringtrain's own). ``superseded``:
    whether a newer world was announced while this one gathers (then ``WorldSuperseded``).
    """
    global _runtime, _generation, _backends
    with _lock:
        if _runtime is not None:
            return _runtime
        env = environ.current() if env is None else env
        config = config or Config.from_env(env)
        _configure_logging(config.log_level)
        adopted = dist.is_initialized()
        if adopted:
            if elastic is not None or Ringtrain.ELASTIC_ID in env:  # joining a later world or not
                raise ConfigError(
                    "an elastic job cannot adopt the process group this script created: ringtrain "
                    "re-forms the world when a rank fails, and that group cannot follow.\n"
                    "HINT: leave init_process_group to ringtrain.init() in elastic jobs."
                )
            placement = _reconcile_adopted(_adopted_placement(env), rank, size)
        else:
            placement = _reconcile(environment.detect(env), rank, size)
        interface = config.network_interface
        if placement.rendezvous_via == "mpi" and not adopted:
            placement, interface = _mpi_rendezvous(placement, config, env)
        _generation += 1
        prefix = f"ringtrain/gen{_generation}"
        if elastic is not None:
            # Renumbered: the launcher's host-local counts no longer hold; topology is measured.
            placement = replace(
                placement, rank=elastic[0], size=elastic[1], local_rank=None, local_size=None
            )
            prefix = f"ringtrain/elastic/gen{elastic[2]}"
        _gloo_environment(interface)
        base = _adopted_store(placement, config) if adopted else _store(placement, config)
        store = world_store(prefix, base, placement, config, adopted, superseded, env)
        backend, transport = backends.choose(config, env, placement)
        _backends = backends
        if config.secure:  # every group is sealed; ranks first prove they hold the job key
            store = backends.seal(store, config, env, placement, transport)
        if not adopted:
            _init_default_group(backend, transport, store, placement, config, superseded)
        comm = None
        try:
            comm = _world_communicator(placement, config, backend, store, env)
            topo = _measure_topology(placement, config, env, comm.group("control"), superseded)
            comm.host = topo.hosts[placement.rank]
            fit_threads_to_quota(env, topo.local_size(placement.rank))
            world = ProcessSet(None)
            world._bind(WORLD_SET_ID, comm)
            global_process_set._bind(WORLD_SET_ID, comm)
            _runtime = Runtime(
                config,
                placement,
                topo,
                placement.rank,
                placement.size,
                _generation,
                world,
                backend=backend,
                adopted=adopted,
            )
            _runtime.process_sets[WORLD_SET_ID] = global_process_set
        except BaseException:
            global_process_set._unbind()
            if adopted:
                if comm is not None:
                    comm.close(destroy_groups=True)
            else:
                _drop_failed_world(config, superseded)
            raise
        log.debug(
            "ringtrain started: rank %d of %d via %s%s, %s",
            placement.rank,
            placement.size,
            placement.launcher,
            " (adopted the script's process group)" if adopted else "",
            topo.describe(),
        )
        return _runtime


def _world_communicator(
    placement: Placement, config: Config, backend: str, store: dist.Store, env: Mapping[str, str]
) -> communicator.Communicator:
    """The world's process set: its groups, made by every rank (collective). In secure mode
    the store values that carry a user's words are sealed (security/notes.py)."""
    notes = Notes(keys.load_job_key(config, env)) if config.secure else PLAIN
    return communicator.create(
        WORLD_SET_ID,
        range(placement.size),
        placement.rank,
        placement.size,
        config.timeout_s,
        backend=backend,
        store=store,
        pairs=config.vector_rounds_at(placement.size),
        notes=notes,
    )


def _gloo_environment(interface: str | None) -> None:
    """HACK: torch reads these Gloo settings only from variables, when a group is made: set
    them before the first group, and never override what the user set."""
    if interface:
        environ.setdefault(Torch.GLOO_SOCKET_IFNAME, interface)
    # Else a Gloo group connects every pair of ranks when it is made: with a communicator's
    # groups, 5 (N - 1) sockets a rank and 5 N store reads at start, while a ring talks to 2
    # neighbours. Lazily, each pair connects at its first exchange: what a job then holds is
    # computed in ringtrain.host.connections, checked at 4 ranks (tests/runtime/test_sockets.py).
    environ.setdefault(Torch.GLOO_LAZY_INIT, "1")


def _drop_failed_world(config: Config, superseded: Callable[[], bool] | None) -> None:
    """Destroy a failed start's groups; those of a replaced world may wait on a lost peer."""
    if superseded is None or not superseded():
        dist.destroy_process_group()
        return
    abandoned_groups.forget_all()
    if _backends is not None:
        _backends.release(config, keep_key=True)


def _init_default_group(
    backend: str,
    transport: str,
    store: dist.Store,
    placement: Placement,
    config: Config,
    superseded: Callable[[], bool] | None = None,
) -> None:
    """The default group; in an elastic job its store's waits end when the world is replaced,
    and so do those of every group made from it (:mod:`.watched_store`)."""
    if superseded is not None:
        store = WatchedStore(store, superseded, config.timeout_s)
    try:
        with rank_prefix.once(placement.rank):  # torch's "[rankN]: " hook, once, not once per world
            dist.init_process_group(
                backend,
                store=store,
                rank=placement.rank,
                world_size=placement.size,
                timeout=datetime.timedelta(seconds=config.timeout_s),
            )
    except RuntimeError as e:
        if transport == "gloo" and "Address family not supported" in str(e):
            raise LaunchEnvironmentError(
                f"Gloo cannot start here: it enumerates network interfaces over netlink, "
                f"which this process cannot use ({e}).\nHINT: enclave runtimes such as "
                "Gramine have no netlink; set RINGTRAIN_TRANSPORT=tcp (ringtrain run "
                "--transport tcp) or leave it at 'auto'."
            ) from e
        raise


def stop() -> None:
    """Tear down every communicator and the default group. A no-op when not initialized."""
    global _runtime
    with _lock:
        rt = _runtime
        if rt is None:
            return
        try:
            for set_id in sorted(rt.process_sets, reverse=True):
                ps = rt.process_sets[set_id]
                if set_id != WORLD_SET_ID:
                    ps.communicator.close()
                    ps._unbind()
            if rt.adopted:
                gc.collect()  # see below
            global_process_set.communicator.close(destroy_groups=rt.adopted)
        finally:
            global_process_set._unbind()
            rt.world._unbind()
            _runtime = None
            if dist.is_initialized() and not rt.adopted:
                # A DDP model kept only by a reference cycle holds the group too. Freed after
                # this, its reducer would drop the group's last reference with the GIL held,
                # and the group's destructor would wait on Gloo threads that need the GIL.
                gc.collect()
                dist.destroy_process_group()
            exit_guard.release_finished()
            if _backends is not None:
                _backends.release(rt.config)


def abandon() -> None:
    """Forget the current world without waiting for its peers (one of which has failed).

    Its process groups are unregistered from torch.distributed but neither shut down nor freed,
    so a new world can be started at once; ringtrain's own groups (sealed, TCP mesh) are left
    (``RingProcessGroup.leave``): their connections close and their workers stop now. Attached
    services must be closed by the caller.
    """
    global _runtime
    with _lock:
        rt = _runtime
        if rt is None:
            return
        for ps in rt.process_sets.values():
            ps._unbind()
        global_process_set._unbind()
        rt.world._unbind()
        _runtime = None
        abandoned_groups.forget_all()
        if _backends is not None:  # the next world authenticates anew, with the same job key
            _backends.release(rt.config, keep_key=True)


def add_process_set(ranks: Sequence[int] | ProcessSet) -> ProcessSet:
    """Register a process set. Collective: every rank of the world calls it with the same ranks."""
    rt = current()
    ps = ranks if isinstance(ranks, ProcessSet) else ProcessSet(ranks)
    if ps.process_set_id is not None:
        raise ConfigError(f"{ps!r} is already registered")
    bad = [r for r in ps.ranks if not 0 <= r < rt.size]
    if bad:
        raise ConfigError(f"process set ranks {bad} are outside the world of size {rt.size}")
    for existing in rt.process_sets.values():
        if existing._ranks is not None and existing._ranks == ps._ranks:
            raise ConfigError(
                f"a process set with ranks {ps.ranks} is already registered as id {existing.process_set_id}"
            )
    set_id = rt.next_set_id
    rt.next_set_id += 1
    comm = communicator.create(
        set_id,
        ps.ranks,
        rt.rank,
        rt.size,
        rt.config.timeout_s,
        backend=rt.backend,
        store=global_process_set.communicator.store,
        host=rt.topology.hosts[rt.rank],
        pairs=rt.config.vector_rounds_at(len(ps.ranks)),
        notes=global_process_set.communicator.notes,
    )
    ps._bind(set_id, comm)
    rt.process_sets[set_id] = ps
    return ps


def remove_process_set(ps: ProcessSet) -> bool:
    """Unregister a process set (collective). Returns False if it was not registered."""
    rt = current()
    if ps.process_set_id in (None, WORLD_SET_ID) or ps.process_set_id not in rt.process_sets:
        return False
    del rt.process_sets[ps.process_set_id]
    ps.communicator.close()
    ps._unbind()
    return True


def _reconcile(p: Placement, rank: int | None, size: int | None) -> Placement:
    """Explicit arguments win only when the launcher said nothing; a contradiction is an error."""
    if rank is None and size is None:
        return p
    if p.launcher != "single":
        if (rank is not None and rank != p.rank) or (size is not None and size != p.size):
            raise LaunchEnvironmentError(
                f"init(rank={rank}, size={size}) contradicts the {p.launcher} launcher, which says "
                f"rank={p.rank}, size={p.size}.\nHINT: drop the arguments and let the launcher decide."
            )
        return p
    if rank is None or size is None:
        raise ConfigError("init(rank=..., size=...) needs both values, or neither")
    from dataclasses import replace

    placed = replace(p, launcher="explicit", rank=rank, size=size)
    environment._validate(placed)
    return placed


def _adopted_placement(env: Mapping[str, str]) -> Placement:
    """The placement of a process whose default group exists: its rank and size are the group's;
    the launcher (if any) still says where the store is and which host this is."""
    from dataclasses import replace

    rank, size = dist.get_rank(), dist.get_world_size()
    try:
        p = environment.detect(env)
    except LaunchEnvironmentError as e:  # half a launcher's variables: the group says enough
        log.debug("adopting the process group; launcher variables ignored: %s", e)
        p = Placement("single", 0, 1, "", 0)
    if p.launcher == "single":
        p = replace(p, launcher="explicit", rank=rank, size=size)
    elif (p.rank, p.size) != (rank, size):
        log.warning(
            "the %s launcher says rank %d of %d, but the process group this script created says "
            "rank %d of %d: using the process group's numbering",
            p.launcher,
            p.rank,
            p.size,
            rank,
            size,
        )
        p = replace(p, rank=rank, size=size, local_rank=None, local_size=None)
    addr, port = _store_address(dist.distributed_c10d._get_default_store())
    if addr:
        p = replace(p, rendezvous_addr=addr, rendezvous_port=port)
    return replace(p, rendezvous_via=None)


def _store_address(store: dist.Store | None) -> tuple[str, int]:
    """Host and port of the TCPStore under ``store``'s prefixes; ("", 0) for other stores."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return str(store.host), int(store.port)
    return "", 0


def _reconcile_adopted(p: Placement, rank: int | None, size: int | None) -> Placement:
    """init(rank=, size=) beside an adopted group: only the group's own numbers are accepted."""
    if (rank is not None and rank != p.rank) or (size is not None and size != p.size):
        raise LaunchEnvironmentError(
            f"init(rank={rank}, size={size}) contradicts the process group this script created, "
            f"which says rank={p.rank}, size={p.size}.\nHINT: drop the arguments: ringtrain "
            "takes its numbering from that group."
        )
    return p


def _adopted_store(p: Placement, config: Config) -> dist.Store:
    """The adopted default group's store; where it has none (an MPI group), rank 0 serves a
    TCPStore and sends its address to the others through the default group itself."""
    store = dist.distributed_c10d._get_default_store()
    if store is not None:
        return store
    where: list[Any] = [None]
    if p.rank == 0:
        interface = environ.current().get(Torch.GLOO_SOCKET_IFNAME) or config.network_interface
        addr = network.local_address(interface, p.rendezvous_addr)
        if addr == "127.0.0.1" and p.size > 1:
            addr = socket.gethostbyname(socket.gethostname())
        served = _new_store(p, addr, 0, True, config)
        _stores[(addr, served.port, True)] = served
        where = [(addr, int(served.port))]
    dist.broadcast_object_list(where, src=0)
    addr, port = where[0]
    if p.rank == 0:
        return _stores[(addr, port, True)]
    key = (addr, port, False)
    if key not in _stores:
        _stores[key] = _new_store(p, addr, port, False, config)
    return _stores[key]


_mpi_placed: tuple[Placement, str] | None = None


def _mpi_rendezvous(p: Placement, config: Config, env: Mapping[str, str]) -> tuple[Placement, str]:
    """Rank 0's address through MPI, once per process: a restart reuses the same store."""
    global _mpi_placed
    if _mpi_placed is None:
        from ringtrain.runtime import mpi_rendezvous

        def serve(addr: str, port: int) -> int:
            store = _new_store(p, addr, port, True, config)
            _stores[(addr, store.port, True)] = store
            return int(store.port)

        host = env.get(Ringtrain.HOSTNAME) or socket.gethostname()
        _mpi_placed = mpi_rendezvous.exchange(p, host, config.network_interface, serve)
    return _mpi_placed


def _store(p: Placement, config: Config) -> dist.Store:
    if p.size == 1 and p.launcher == "single":
        return dist.HashStore()
    is_master = p.rank == 0 and not p.store_hosted
    key = (p.rendezvous_addr, p.rendezvous_port, is_master)
    if key not in _stores:
        _stores[key] = _new_store(p, p.rendezvous_addr, p.rendezvous_port, is_master, config)
    return dist.PrefixStore(p.store_prefix, _stores[key]) if p.store_prefix else _stores[key]


def _new_store(
    p: Placement, addr: str, port: int, is_master: bool, config: Config
) -> dist.TCPStore:
    """The TCPStore at ``addr:port``: served here (``is_master``) or reached; a port another
    program holds fails the job naming it (see :mod:`ringtrain.runtime.store_connect`)."""
    return store_connect.connect(p.rank, addr, port, is_master, config.timeout_s)


def fit_threads_to_quota(
    env: Mapping[str, str], local_size: int, root: Path = cpu_limits.ROOT
) -> int | None:
    """Cap torch's threads at this rank's share of the cgroup CPU quota; the new count, if cut.

    Ranks that ``ringtrain run`` did not start (mpirun, torchrun, a pod) get no thread plan, and
    torch starts one thread per core of the affinity mask: in a shared CPU pool that is every
    core of the node, far more than the quota lets run. A user's OMP_NUM_THREADS is kept.
    """
    if Threads.OMP_NUM_THREADS in env:
        return None
    quota = cpu_limits.cpu_quota(root)
    if quota is None:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, cpu_limits.cpu_budget(cores or 1, quota) // max(1, local_size))
    if torch.get_num_threads() <= share:
        return None
    log.info(
        "cgroup CPU quota %.3g CPUs for %d rank(s) here: torch threads %d -> %d",
        quota,
        local_size,
        torch.get_num_threads(),
        share,
    )
    torch.set_num_threads(share)
    return share


def _measure_topology(
    p: Placement,
    config: Config,
    env: Mapping[str, str],
    group: Group,
    superseded: Callable[[], bool] | None,
) -> Topology:
    """Every rank's host, gathered over ``group``: the launcher's node where it names one, else
    the hostname with the address of the interface the job uses (see :mod:`.topology`). The
    world's first exchange: in an elastic world, it ends when a newer world is announced."""
    me = _host_identity(p, config, env)
    if p.size == 1:
        return topology.from_identities([me])
    every: list[Any] = [None] * p.size
    if superseded is None:
        dist.all_gather_object(every, me, group=group)
    else:
        every = forming_gather.all_gather_object(me, p.size, group, superseded, config.timeout_s)
    topo = topology.from_identities(every)
    if p.local_size is not None and p.local_size != topo.local_size(p.rank):
        log.warning(
            "the %s launcher says %d ranks run on this host, but %d ranks report host %r; "
            "using the measured placement",
            p.launcher,
            p.local_size,
            topo.local_size(p.rank),
            topo.hosts[p.rank],
        )
    return topo


def _host_identity(p: Placement, config: Config, env: Mapping[str, str]) -> topology.HostIdentity:
    name = env.get(Ringtrain.HOSTNAME) or socket.gethostname()
    if p.node is not None or p.size == 1:
        return topology.HostIdentity(name, p.node or "")
    interface = env.get(Torch.GLOO_SOCKET_IFNAME) or config.network_interface
    return topology.HostIdentity(name, network.local_address(interface, p.rendezvous_addr))
