"""Ranks for Ray workers: which worker is which rank, and the environment each one gets.

Pure functions of what the workers report (their Ray node), so they are tested without Ray.
A host is a Ray node, named by its node address (the launcher's answer, ``RINGTRAIN_HOSTNAME``),
never by ``socket.gethostname()``: cloned VMs and containers share hostnames. Two Ray nodes on one
address are one machine (Ray's own local test clusters); ranks there share memory, so they count
as one host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringtrain.config import Config, env_var
from ringtrain.errors import ConfigError
from ringtrain.launch import rank_env
from ringtrain.launch.plan import ProcessSpec


@dataclass(frozen=True)
class WorkerFacts:
    """What a Ray worker says about itself."""

    node_ip: str
    node_id: str
    hostname: str
    pid: int


def host_major(facts: Sequence[WorkerFacts]) -> list[int]:
    """Worker indices reordered so each host's workers are consecutive, hosts in order of their
    first worker (stable within a host): the rank order ``ringtrain run`` uses."""
    hosts = list(dict.fromkeys(f.node_ip for f in facts))
    return sorted(range(len(facts)), key=lambda i: (hosts.index(facts[i].node_ip), i))


def specs(facts: Sequence[WorkerFacts]) -> list[ProcessSpec]:
    """One placement per worker, rank = position in ``facts`` (order them first)."""
    hosts = list(dict.fromkeys(f.node_ip for f in facts))
    local_rank: list[int] = []
    seen: dict[str, int] = {}
    for f in facts:
        local_rank.append(seen.get(f.node_ip, 0))
        seen[f.node_ip] = local_rank[-1] + 1
    out = []
    for r, f in enumerate(facts):
        lr = local_rank[r]
        # Horovod's cross group: the ranks holding this local rank, one per host that has it.
        peers = [q for q in range(len(facts)) if local_rank[q] == lr]
        out.append(
            ProcessSpec(
                rank=r,
                size=len(facts),
                host=f.node_ip,
                host_index=hosts.index(f.node_ip),
                local_rank=lr,
                local_size=seen[f.node_ip],
                cross_rank=peers.index(r),
                cross_size=len(peers),
                argv=(),
            )
        )
    return out


def rank_environment(
    spec: ProcessSpec, addr: str, port: int, job_id: str, *, store_hosted: bool
) -> dict[str, str]:
    """The variables of one rank: the ones ``ringtrain run`` gives (both spellings)."""
    return rank_env.placement(spec, rank_env.Rendezvous(addr, port, job_id), hosted=store_hosted)


def settings_environment(settings: Mapping[str, object]) -> dict[str, str]:
    """``RINGTRAIN_*`` twins of Config settings (``{"network_interface": "eth1"}``), checked
    against Config here, on the driver, rather than in every worker."""
    Config.from_env({}, **settings)  # raises ConfigError naming an unknown or bad setting
    env = {}
    for name, value in settings.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = "1" if value else "0"
        env[env_var(name)] = str(value)
    return env


def check_counts(
    num_workers: int | None,
    num_hosts: int | None,
    num_workers_per_host: int,
    min_workers: int | None,
    max_workers: int | None,
    use_gpu: bool,
    gpus_per_worker: int | None,
    cpus_per_worker: float,
) -> None:
    """Horovod's RayExecutor argument rules, with ringtrain's error class (a ValueError)."""
    if max_workers and (not min_workers or min_workers <= 0):
        raise ConfigError(
            "max_workers was given without a positive min_workers.\n"
            "HINT: elastic jobs need min_workers >= 1 (and max_workers >= min_workers)."
        )
    if min_workers is not None and (num_workers is not None or num_hosts is not None):
        raise ConfigError(
            "both min_workers (elastic) and num_workers/num_hosts (fixed size) were given.\n"
            "HINT: give min_workers[/max_workers] for an elastic job, or num_workers "
            "(or num_hosts x num_workers_per_host) for a fixed one."
        )
    if min_workers is None and num_workers is None and num_hosts is None:
        raise ConfigError(
            "no worker count: give num_workers, num_hosts (x num_workers_per_host) or "
            "min_workers[/max_workers]."
        )
    if num_workers is not None and num_hosts is not None:
        raise ConfigError(
            f"num_workers={num_workers} and num_hosts={num_hosts} were both given.\n"
            "HINT: num_hosts x num_workers_per_host is the alternative to num_workers."
        )
    if min_workers is not None and max_workers is not None and max_workers < min_workers:
        raise ConfigError(f"max_workers={max_workers} is below min_workers={min_workers}")
    for name, value in (
        ("num_workers", num_workers),
        ("num_hosts", num_hosts),
        ("num_workers_per_host", num_workers_per_host),
        ("min_workers", min_workers),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if cpus_per_worker <= 0:
        raise ConfigError(f"cpus_per_worker must be > 0, got {cpus_per_worker}")
    if gpus_per_worker and not use_gpu:
        raise ConfigError(
            "gpus_per_worker is set, but use_gpu is False.\nHINT: pass use_gpu=True as well."
        )
    if use_gpu and gpus_per_worker is not None and gpus_per_worker < 1:
        raise ConfigError(f"gpus_per_worker must be >= 1, got {gpus_per_worker}")
