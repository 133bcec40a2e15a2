"""CPU tuning for CPU training: core binding, OpenMP threads and the allocator, per rank.

Ranks that share cores fight: each PyTorch process starts one OpenMP thread per core by default,
so four ranks on eight cores run 32 busy threads. Giving each rank its own cores and setting
``OMP_NUM_THREADS`` to their number removes that contention. All of this is pure: it takes the
facts an agent reports about its host and returns what each rank should get.

A cgroup CPU quota (:mod:`ringtrain.host.cpu_limits`) caps the plan too. With a quota smaller
than the cores in the affinity mask (a pod in Kubernetes' shared CPU pool), threads are sized by
the quota, and ``auto`` binds nothing: the cores are shared with other pods, so pinning a rank to
some of them only takes the scheduler's freedom to use idle ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ringtrain.environ import Process, Threads
from ringtrain.errors import LaunchError
from ringtrain.host.cpu_limits import cpu_budget, is_shared_pool

ALLOCATORS = {
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
    "tcmalloc": ("libtcmalloc.so.4", "libtcmalloc_minimal.so.4", "libtcmalloc.so"),
}
LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


@dataclass(frozen=True)
class HostFacts:
    """What an agent reports about its host; see :func:`ringtrain.launch.agent.host_facts`."""

    hostname: str
    cpus: tuple[int, ...]
    numa_nodes: tuple[tuple[int, ...], ...] = ()
    allocators: Mapping[str, str] = field(default_factory=dict)
    cpu_quota: float | None = None  # CPUs' worth of time (cgroup cpu.max); None: no quota


@dataclass(frozen=True)
class RankTuning:
    cpus: tuple[int, ...] | None  # None: not bound
    env: dict[str, str]
    summary: str


def tune(
    facts: HostFacts,
    local_size: int,
    bind_to: str,
    malloc: str,
    user_env: Mapping[str, str],
    beside: int = 0,
) -> list[RankTuning]:
    """Tuning for each local rank of one host. ``user_env`` settings (e.g. OMP_NUM_THREADS) win.

    ``beside``: ranks of the job already running on the host that these join (an elastic job
    growing onto a host it uses). Those hold the host's cores, bound or not, so the new ranks
    are bound to none and their threads are sized for all the host's ranks, old and new."""
    cpus = list(facts.cpus) or [0]
    budget = cpu_budget(len(cpus), facts.cpu_quota)
    shared = is_shared_pool(len(cpus), facts.cpu_quota)
    mode = "none" if beside else bind_to
    if mode == "auto":
        # Binding only helps when every rank can have a core to itself, not shared with others.
        mode = "core" if local_size <= len(cpus) and not shared else "none"
    if mode == "numa" and len(facts.numa_nodes) < 2:
        mode = "core" if local_size <= len(cpus) else "none"
    preload = _preload(facts, malloc)
    out = []
    for local_rank in range(local_size):
        mine = _cpus_for(local_rank, local_size, cpus, facts.numa_nodes, mode)
        ranks_here = local_size + beside
        threads = max(1, len(mine) if mine is not None else len(cpus) // ranks_here)
        threads = max(1, min(threads, budget // ranks_here))  # the quota's share, if lower
        env: dict[str, str] = {}
        if Threads.OMP_NUM_THREADS not in user_env:
            env[Threads.OMP_NUM_THREADS] = str(threads)
        if preload:
            prior = user_env.get(Process.LD_PRELOAD, "")
            env[Process.LD_PRELOAD] = f"{preload}:{prior}" if prior else preload
        shown_cpus = _ranges(mine) if mine is not None else "any"
        summary = (
            f"bind={mode} cpus={shown_cpus} "
            f"OMP_NUM_THREADS={env.get(Threads.OMP_NUM_THREADS, user_env.get(Threads.OMP_NUM_THREADS))} "
            f"malloc={malloc if preload else 'system'}"
            + (f" cpu-quota={facts.cpu_quota:g}" if facts.cpu_quota is not None else "")
            + (f" beside={beside} running rank(s)" if beside else "")
        )
        out.append(RankTuning(tuple(mine) if mine is not None else None, env, summary))
    return out


def _cpus_for(
    local_rank: int,
    local_size: int,
    cpus: Sequence[int],
    numa_nodes: Sequence[Sequence[int]],
    mode: str,
) -> list[int] | None:
    if mode == "none":
        return None
    if mode == "numa":
        node = [c for c in numa_nodes[local_rank % len(numa_nodes)] if c in cpus]
        return node or None
    per = len(cpus) // local_size
    if per == 0:  # asked for cores with more ranks than cores: one each, shared in turn
        return [cpus[local_rank % len(cpus)]]
    return list(cpus[local_rank * per : (local_rank + 1) * per])


def _preload(facts: HostFacts, malloc: str) -> str:
    if malloc == "system":
        return ""
    path = facts.allocators.get(malloc)
    if not path:
        raise LaunchError(
            f"--malloc {malloc}: no {malloc} library found on host {facts.hostname}.\n"
            f"HINT: install it (Debian: apt-get install lib{malloc}2 / libgoogle-perftools4) "
            "or use --malloc system."
        )
    return path


def _ranges(cpus: Sequence[int]) -> str:
    if not cpus:
        return "-"
    parts, start, prev = [], cpus[0], cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)
