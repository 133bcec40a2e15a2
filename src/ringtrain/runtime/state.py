"""Initialization and shutdown: the one place that owns this process's distributed state.

``start()`` reads the launch environment, connects to the rendezvous store, creates the default
process group, measures the host placement, and creates the world's communicator. ``stop()``
undoes all of it, so ``start(); stop(); start()`` works again and again in one process: each
start uses a fresh key prefix ("generation") in the same store, and stores are kept for the
process's lifetime because a TCPStore server cannot be rebound reliably while peers reconnect.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ringtrain import environ
from ringtrain.config import Config
from ringtrain.environ import Ringtrain, Threads, Torch
from ringtrain.errors import ConfigError, LaunchEnvironmentError, NotInitializedError
from ringtrain.host import cpu_limits
from ringtrain.runtime import communicator, environment, topology
from ringtrain.runtime.backends import GroupBackends
from ringtrain.runtime.environment import Placement
from ringtrain.runtime.process_sets import ProcessSet
from ringtrain.runtime.topology import Topology

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
_stores: dict[tuple[str, int, bool], Any] = {}
_backends: GroupBackends | None = None  # the running job's, to release at stop/abandon
global_process_set = ProcessSet(None)


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
) -> Runtime:
    """Join the job described by the environment. Idempotent while already initialized.

    ``elastic``: ``(rank, size, generation)`` of a world the launcher announced (see
    :mod:`ringtrain.runtime.membership`); the store prefix then comes from the launcher's
    generation, so survivors agree on it whatever each one did before. ``backends``: the
    process-group backends to choose from (``lifecycle`` passes ringtrain's own).
    """
    global _runtime, _generation, _backends
    with _lock:
        if _runtime is not None:
            return _runtime
        env = environ.current() if env is None else env
        config = config or Config.from_env(env)
        _configure_logging(config.log_level)
        placement = _reconcile(environment.detect(env), rank, size)
        interface = config.network_interface
        if placement.rendezvous_via == "mpi":
            placement, interface = _mpi_rendezvous(placement, config, env)
        _generation += 1
        prefix = f"ringtrain/gen{_generation}"
        if elastic is not None:
            from dataclasses import replace

            # Renumbered: the launcher's host-local counts no longer hold; topology is measured.
            placement = replace(
                placement, rank=elastic[0], size=elastic[1], local_rank=None, local_size=None
            )
            prefix = f"ringtrain/elastic/gen{elastic[2]}"
        if interface:
            # HACK: torch reads Gloo's interface only from this variable; set it before the
            # first group is created, and never override what the user set.
            environ.setdefault(Torch.GLOO_SOCKET_IFNAME, interface)
        store = dist.PrefixStore(prefix, _store(placement, config))
        backend, transport = backends.choose(config, env, placement)
        _backends = backends
        if config.secure:  # every group is sealed; ranks first prove they hold the job key
            store = backends.seal(store, config, env, placement, transport)
        try:
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
        try:
            topo = _measure_topology(placement, env)
            fit_threads_to_quota(env, topo.local_size(placement.rank))
            world = ProcessSet(None)
            comm = communicator.create(
                WORLD_SET_ID,
                range(placement.size),
                placement.rank,
                placement.size,
                config.timeout_s,
                backend=backend,
                store=store,
                host=topo.hosts[placement.rank],
            )
            world._bind(WORLD_SET_ID, comm)
            global_process_set._bind(WORLD_SET_ID, comm)
            _runtime = Runtime(
                config, placement, topo, placement.rank, placement.size, _generation, world
            )
            _runtime.process_sets[WORLD_SET_ID] = global_process_set
        except BaseException:
            dist.destroy_process_group()
            raise
        log.debug(
            "ringtrain started: rank %d of %d via %s, %s",
            placement.rank,
            placement.size,
            placement.launcher,
            topo.describe(),
        )
        return _runtime


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
            global_process_set.communicator.close()
        finally:
            global_process_set._unbind()
            rt.world._unbind()
            _runtime = None
            if dist.is_initialized():
                # A DDP model kept only by a reference cycle holds the group too. Freed after
                # this, its reducer would drop the group's last reference with the GIL held,
                # and the group's destructor would wait on Gloo threads that need the GIL.
                gc.collect()
                dist.destroy_process_group()
            if _backends is not None:
                _backends.release(rt.config)


# Groups of abandoned worlds: destroying one with an op stuck in it blocks until that op's
# timeout, and so would dropping the last reference; they are kept for the process's lifetime.
_abandoned: list[Any] = []


def _keep_past_exit(obj: Any) -> None:
    """Hold ``obj`` with a reference the interpreter never drops, not even while it clears the
    modules at exit: a group still waiting on a silent peer (a cut link) would otherwise block
    the process's exit in its destructor until the transport timeout."""
    import ctypes

    # HACK: a deliberate leak; the OS frees the group when the process exits.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


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
        c10d = dist.distributed_c10d
        world = c10d._world
        for group in world.pg_map:
            _abandoned.append(group)
            _keep_past_exit(group)
            leave = getattr(group, "leave", None)  # ringtrain's own groups stop without waiting
            if callable(leave):
                leave()
        # HACK: destroy_process_group() minus the shutdown of each group (which blocks on a
        # group whose peer vanished): torch has no public call to drop its registry only.
        c10d._update_default_pg(None)
        for table in (
            world.pg_map,
            world.pg_names,
            world.pg_group_ranks,
            world.pg_backend_config,
            world.pg_to_tag,
            world.tags_to_pg,
            world.pg_coalesce_state,
        ):
            table.clear()
        c10d._unregister_all_process_groups()
        world.group_count = 0
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
        backend=dist.get_backend(),
        store=global_process_set.communicator.store,
        host=rt.topology.hosts[rt.rank],
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


def _store(p: Placement, config: Config) -> Any:
    if p.size == 1 and p.launcher == "single":
        return dist.HashStore()
    is_master = p.rank == 0 and not p.store_hosted
    key = (p.rendezvous_addr, p.rendezvous_port, is_master)
    if key not in _stores:
        _stores[key] = _new_store(p, p.rendezvous_addr, p.rendezvous_port, is_master, config)
    return _stores[key]


def _new_store(p: Placement, addr: str, port: int, is_master: bool, config: Config) -> Any:
    try:
        return dist.TCPStore(
            addr,
            port,
            world_size=None,
            is_master=is_master,
            timeout=datetime.timedelta(seconds=config.timeout_s),
            wait_for_workers=False,
            use_libuv=True,
        )
    except (RuntimeError, OSError) as e:
        role = "serve" if is_master else "reach"
        raise LaunchEnvironmentError(
            f"rank {p.rank} could not {role} the rendezvous store at {addr}:{port} ({e}).\n"
            "HINT: check that the address is reachable from every host and the port is free; "
            "`ringtrain doctor` checks both."
        ) from e


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


def _measure_topology(p: Placement, env: Mapping[str, str]) -> Topology:
    host = env.get(Ringtrain.HOSTNAME) or socket.gethostname()
    if p.size == 1:
        return topology.from_hosts([host])
    hosts: list[Any] = [None] * p.size
    dist.all_gather_object(hosts, host)
    topo = topology.from_hosts(hosts)
    if p.local_size is not None and p.local_size != topo.local_size(p.rank):
        log.warning(
            "the %s launcher says %d ranks run on this host, but %d ranks report host %r; "
            "using the measured placement",
            p.launcher,
            p.local_size,
            topo.local_size(p.rank),
            host,
        )
    return topo
