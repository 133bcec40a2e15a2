"""Where was this process started? One adapter per launcher, and nothing else reads their variables.

Each adapter turns a launcher's variables into a :class:`Placement`: this process's rank, the world
size, where the rendezvous store is, and the launcher's name for this rank's host when it has one
(``node``: ringtrain's host spec, torchrun's node rank, Slurm's node, a pod). Local and cross ranks
given by a launcher are kept only as a cross-check: the host placement is gathered after the
process group exists (:mod:`ringtrain.runtime.topology`), from the launcher's node where there is
one, because launchers disagree on what "local" means and placements may be uneven (4-3-1).

Adapters are tried in order; the first whose marker variable is present wins. All functions here
are pure functions of a mapping, so each launcher is tested by its variables alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ringtrain.environ import MPICH, Kubeflow, OpenMPI, Ringtrain, Slurm, Torch
from ringtrain.errors import LaunchEnvironmentError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class Placement:
    """This process's place in the job, as its launcher described it."""

    launcher: str
    rank: int
    size: int
    rendezvous_addr: str
    rendezvous_port: int
    # True when something other than rank 0 already serves the store (torchrun's agent, a test
    # harness, ringtrain's launcher): then every rank, rank 0 included, connects as a client.
    store_hosted: bool = False
    local_rank: int | None = None
    local_size: int | None = None
    # "mpi" when the launcher gave no address and ranks span hosts: the address is exchanged
    # through MPI itself at init (:mod:`ringtrain.runtime.mpi_rendezvous`).
    rendezvous_via: str | None = None
    # The launcher's name for this rank's host; ranks with one node share a host, whatever their
    # hostnames say (cloned VMs and containers often share one). None: the launcher has none.
    node: str | None = None
    # Where the launcher's store outlives a try of the job (torchrun's agent keeps its store when
    # it restarts the workers, --max-restarts): this try's keys live under this prefix, as torch's
    # own env:// rendezvous puts them, so none is read from an earlier try's dead ranks.
    store_prefix: str = ""


def detect(env: Mapping[str, str]) -> Placement:
    """The placement described by ``env``; a single process (rank 0 of 1) when no launcher is."""
    for marker, adapter in _ADAPTERS:
        if marker(env):
            placement = adapter(env)
            _validate(placement)
            return placement
    return Placement("single", 0, 1, "127.0.0.1", 0)


def _int(env: Mapping[str, str], var: str, launcher: str) -> int:
    raw = env.get(var)
    if raw is None:
        raise LaunchEnvironmentError(
            f"{launcher} launch detected but {var} is not set.\n"
            f"HINT: start the job with the {launcher} command as documented, or unset the "
            "variables that made ringtrain think it was started by it."
        )
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvironmentError(f"{var}={raw!r} is not an integer") from None


def _node(env: Mapping[str, str], var: str) -> str | None:
    """A launcher's node number, as the host's identity; None when unset."""
    raw = env.get(var, "").strip()
    return f"{var}={raw}" if raw else None


def _opt_int(env: Mapping[str, str], var: str) -> int | None:
    raw = env.get(var)
    return int(raw) if raw not in (None, "") else None


def _rendezvous(
    env: Mapping[str, str], launcher: str, default_port: int | None = None
) -> tuple[str, int]:
    addr = env.get(Ringtrain.RENDEZVOUS_ADDR) or env.get(Torch.MASTER_ADDR)
    port_raw = env.get(Ringtrain.RENDEZVOUS_PORT) or env.get(Torch.MASTER_PORT)
    if not addr:
        raise LaunchEnvironmentError(
            f"started by {launcher}, but no rendezvous address is set.\n"
            "HINT: export MASTER_ADDR=<address of rank 0's host> and MASTER_PORT=<free port> to "
            "every rank (e.g. `mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ...`), "
            "or start the job with `ringtrain run`."
        )
    if port_raw:
        try:
            port = int(port_raw)
        except ValueError:
            raise LaunchEnvironmentError(
                f"rendezvous port {port_raw!r} is not an integer"
            ) from None
    elif default_port is not None:
        port = default_port
    else:
        port = DEFAULT_PORT
    return addr, port


def _ringtrain(env: Mapping[str, str]) -> Placement:
    addr, port = _rendezvous(env, "ringtrain run")
    return Placement(
        "ringtrain",
        _int(env, Ringtrain.RANK, "ringtrain run"),
        _int(env, Ringtrain.SIZE, "ringtrain run"),
        addr,
        port,
        store_hosted=env.get(Ringtrain.RENDEZVOUS_HOSTED, "0") == "1",
        local_rank=_opt_int(env, Ringtrain.LOCAL_RANK),
        local_size=_opt_int(env, Ringtrain.LOCAL_SIZE),
        node=env.get(Ringtrain.HOSTNAME) or None,
    )


def _torchrun(env: Mapping[str, str]) -> Placement:
    addr, port = _rendezvous(env, "torchrun")
    hosted = env.get(Torch.TORCHELASTIC_USE_AGENT_STORE, "").lower() == "true"
    attempt = env.get(Torch.TORCHELASTIC_RESTART_COUNT, "0")
    return Placement(
        "torchrun",
        _int(env, Torch.RANK, "torchrun"),
        _int(env, Torch.WORLD_SIZE, "torchrun"),
        addr,
        port,
        # torchrun's agent serves the store when it says so; older versions leave it to rank 0.
        store_hosted=hosted,
        local_rank=_opt_int(env, Torch.LOCAL_RANK),
        local_size=_opt_int(env, Torch.LOCAL_WORLD_SIZE),
        # torchrun numbers its agents (one per node); Ray Train and Lightning say NODE_RANK.
        node=_node(env, Torch.GROUP_RANK) or _node(env, Torch.NODE_RANK),
        store_prefix=f"/worker/attempt_{attempt}" if hosted else "",
    )


def _openmpi(env: Mapping[str, str]) -> Placement:
    rank = _int(env, OpenMPI.RANK, "Open MPI")
    size = _int(env, OpenMPI.SIZE, "Open MPI")
    local_rank = _opt_int(env, OpenMPI.LOCAL_RANK)
    local_size = _opt_int(env, OpenMPI.LOCAL_SIZE)
    via = None
    if env.get(Ringtrain.RENDEZVOUS_ADDR) or env.get(Torch.MASTER_ADDR):
        addr, port = _rendezvous(env, "Open MPI (mpirun)")
    elif local_size == size:
        # A plain `mpirun -np N` on one host: every rank derives the same loopback port from
        # the job id mpirun gave them, so nothing needs exporting.
        addr = "127.0.0.1"
        port = _opt_int(env, Ringtrain.RENDEZVOUS_PORT) or _opt_int(env, Torch.MASTER_PORT) or 0
        port = port or _job_port(env.get(OpenMPI.JOB_ID, ""))
    else:
        # Ranks on several hosts and no address given: rank 0's address travels through MPI.
        addr, via = "", "mpi"
        port = _opt_int(env, Ringtrain.RENDEZVOUS_PORT) or _opt_int(env, Torch.MASTER_PORT) or 0
    return Placement(
        "openmpi",
        rank,
        size,
        addr,
        port,
        local_rank=local_rank,
        local_size=local_size,
        rendezvous_via=via,
    )


def job_id(env: Mapping[str, str]) -> str | None:
    """What tells this job from another run of the same command, where its launcher says:
    ringtrain run's job id, torchrun's run id, Slurm's job and step, Open MPI's job id."""
    if env.get(Ringtrain.JOB_ID):
        return env[Ringtrain.JOB_ID]
    run = env.get(Torch.TORCHELASTIC_RUN_ID, "none")
    if run != "none":  # torchrun's default --rdzv-id: the same in every run
        return f"torchrun {run}"
    if env.get(Slurm.JOB_ID):
        return f"slurm {env[Slurm.JOB_ID]}.{env.get(Slurm.STEP_ID, '0')}"
    if env.get(OpenMPI.JOB_ID):
        return f"mpirun {env[OpenMPI.JOB_ID]}"
    return None


def _job_port(job_id: str) -> int:
    """A port every rank of one job derives alike: 20000-32767, below Linux's ephemeral range."""
    return 20000 + (int(job_id) % 12768 if job_id.isdigit() else 0)


def _pmi(env: Mapping[str, str]) -> Placement:
    addr, port = _rendezvous(env, "MPICH/Intel MPI (mpiexec)")
    return Placement(
        "mpich",
        _int(env, MPICH.RANK, "MPICH/Intel MPI"),
        _int(env, MPICH.SIZE, "MPICH/Intel MPI"),
        addr,
        port,
        local_rank=_opt_int(env, MPICH.LOCAL_RANK),
        local_size=_opt_int(env, MPICH.LOCAL_SIZE),
    )


def _slurm(env: Mapping[str, str]) -> Placement:
    nodelist = (
        env.get(Slurm.STEP_NODELIST) or env.get(Slurm.JOB_NODELIST) or env.get(Slurm.NODELIST)
    )
    fallback_addr = expand_nodelist(nodelist)[0] if nodelist else None
    merged = dict(env)
    if fallback_addr and not (env.get(Ringtrain.RENDEZVOUS_ADDR) or env.get(Torch.MASTER_ADDR)):
        merged[Torch.MASTER_ADDR] = fallback_addr
    # Every task derives the same port from the job and step ids, so no extra variable is
    # needed; each step its own, as one allocation may run steps at once (srun --exact ... &),
    # whose ranks would otherwise meet in one store and sum each other's tensors.
    job, step = env.get(Slurm.JOB_ID, "0"), env.get(Slurm.STEP_ID, "0")
    number = int(job) * 61 + int(step) if job.isdigit() and step.isdigit() else 0
    default_port = _job_port(str(number))
    addr, port = _rendezvous(merged, "Slurm (srun)", default_port=default_port)
    return Placement(
        "slurm",
        _int(env, Slurm.PROCID, "Slurm"),
        _int(env, Slurm.NTASKS, "Slurm"),
        addr,
        port,
        local_rank=_opt_int(env, Slurm.LOCALID),
        local_size=_slurm_local_size(env),
        node=_node(env, Slurm.NODEID),
    )


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    per_node = env.get(Slurm.STEP_TASKS_PER_NODE) or env.get(Slurm.TASKS_PER_NODE)
    node_id = _opt_int(env, Slurm.NODEID)
    if not per_node or node_id is None:
        return None
    counts: list[int] = []
    for part in per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else None


def _kubeflow(env: Mapping[str, str]) -> Placement:
    """A PyTorchJob pod started without torchrun: RANK is the pod's index, not the process rank."""
    addr, port = _rendezvous(
        {
            **env,
            Torch.MASTER_ADDR: env.get(Torch.MASTER_ADDR) or env.get(Kubeflow.MASTER_ADDR, ""),
            Torch.MASTER_PORT: env.get(Torch.MASTER_PORT) or env.get(Kubeflow.MASTER_PORT, ""),
        },
        "a Kubeflow PyTorchJob",
    )
    pod = _int(env, Torch.RANK, "Kubeflow PyTorchJob")
    nproc_raw = env.get(Kubeflow.NPROC_PER_NODE, "1")
    nproc = int(nproc_raw) if nproc_raw.isdigit() else 1
    nnodes_raw = env.get(Kubeflow.NNODES, "")
    # PET_NNODES may be a range ("1:4") for elastic jobs; the fixed size is then WORLD_SIZE pods.
    nnodes = (
        int(nnodes_raw)
        if nnodes_raw.isdigit()
        else _int(env, Torch.WORLD_SIZE, "Kubeflow PyTorchJob")
    )
    local = _opt_int(env, Torch.LOCAL_RANK) or 0
    return Placement(
        "kubeflow",
        pod * nproc + local,
        nnodes * nproc,
        addr,
        port,
        local_rank=local,
        local_size=nproc,
        node=f"pod {pod}",
    )


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``node[01-03,07],gpu5`` into host names, in order."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?(?:,|$)", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if not prefix and not ranges:
            continue
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not hi:
                hosts.append(prefix + lo)
                continue
            width = len(lo)
            hosts += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
    if not hosts:
        raise LaunchEnvironmentError(f"could not parse the Slurm node list {nodelist!r}")
    return hosts


def _validate(p: Placement) -> None:
    if p.size < 1:
        raise LaunchEnvironmentError(f"{p.launcher}: world size must be >= 1, got {p.size}")
    if not 0 <= p.rank < p.size:
        raise LaunchEnvironmentError(
            f"{p.launcher}: rank {p.rank} is outside the world of size {p.size}"
        )
    if (
        p.local_rank is not None
        and p.local_size is not None
        and not 0 <= p.local_rank < p.local_size
    ):
        raise LaunchEnvironmentError(
            f"{p.launcher}: local rank {p.local_rank} is outside the local size {p.local_size}"
        )


_ADAPTERS: list[
    tuple[Callable[[Mapping[str, str]], bool], Callable[[Mapping[str, str]], Placement]]
] = [
    (lambda e: Ringtrain.RANK in e, _ringtrain),
    (
        lambda e: (
            Torch.TORCHELASTIC_RUN_ID in e or (Torch.LOCAL_RANK in e and Torch.GROUP_RANK in e)
        ),
        _torchrun,
    ),
    (lambda e: OpenMPI.RANK in e, _openmpi),
    (lambda e: MPICH.RANK in e, _pmi),
    (lambda e: Slurm.PROCID in e and Slurm.NTASKS in e, _slurm),
    (
        lambda e: (
            Torch.RANK in e
            and (Kubeflow.NNODES in e or Kubeflow.NPROC_PER_NODE in e or Kubeflow.MASTER_ADDR in e)
        ),
        _kubeflow,
    ),
    # A bare RANK/WORLD_SIZE/MASTER_ADDR set (e.g. a hand-written script): same as torchrun's.
    (lambda e: Torch.RANK in e and Torch.WORLD_SIZE in e and Torch.MASTER_ADDR in e, _torchrun),
]
