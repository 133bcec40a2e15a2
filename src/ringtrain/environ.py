"""The one table of environment variables: every variable ringtrain reads or writes, named here.

Nothing else in ``src/`` spells a variable's name or touches ``os.environ``: other modules take a
mapping (``env``) and the names below, so each is testable with a plain dict, and a launcher's
variables can be found in one place. ``tests/test_environ.py`` holds that rule.

    settings     ``RINGTRAIN_<FIELD>`` for each :class:`~ringtrain.config.Config` field
                 (:func:`setting_var`), and Horovod's knobs mapped onto the same fields
                 (:data:`HOROVOD_VARS`)
    Ringtrain    placement, rendezvous and elastic variables ``ringtrain run`` writes per rank
    Horovod      the ones ``horovodrun`` writes, written too so Horovod scripts keep working
    Torch        torchrun's, torch.distributed's and the backends' (Gloo, NCCL, CUDA)
    OpenMPI, MPICH, Slurm, Kubeflow    the other launchers' and operators' placement variables
    Threads, Process                   thread pools and the interpreter's own

Reading: :func:`current`. Writing (before a group exists, or in a test harness): :func:`set_var`,
:func:`setdefault`, :func:`update`, :func:`pop`.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from ringtrain.errors import ConfigError

PREFIX = "RINGTRAIN_"


def setting_var(field: str) -> str:
    """The variable twin of a Config field: ``RINGTRAIN_`` + its name in upper case."""
    return PREFIX + field.upper()


class Ringtrain:
    """Written per rank by ``ringtrain run`` (launch/rank_env.py); read as placement."""

    RANK = "RINGTRAIN_RANK"
    SIZE = "RINGTRAIN_SIZE"
    LOCAL_RANK = "RINGTRAIN_LOCAL_RANK"
    LOCAL_SIZE = "RINGTRAIN_LOCAL_SIZE"
    CROSS_RANK = "RINGTRAIN_CROSS_RANK"
    CROSS_SIZE = "RINGTRAIN_CROSS_SIZE"
    HOSTNAME = "RINGTRAIN_HOSTNAME"
    RENDEZVOUS_ADDR = "RINGTRAIN_RENDEZVOUS_ADDR"
    RENDEZVOUS_PORT = "RINGTRAIN_RENDEZVOUS_PORT"
    # "1": the launcher serves the store, so rank 0 connects as a client too
    RENDEZVOUS_HOSTED = "RINGTRAIN_RENDEZVOUS_HOSTED"
    JOB_ID = "RINGTRAIN_JOB_ID"
    KEY_FD = "RINGTRAIN_KEY_FD"  # the job key, on an inherited file descriptor
    HEARTBEAT_FD = "RINGTRAIN_HEARTBEAT_FD"  # the agent's heartbeat pipe (runtime/heartbeat.py)
    # elastic jobs: the rank's stable identity and the launcher's limits (launch/elastic.py)
    ELASTIC_ID = "RINGTRAIN_ELASTIC_ID"
    ELASTIC_TIMEOUT = "RINGTRAIN_ELASTIC_TIMEOUT"
    ELASTIC_RESET_LIMIT = "RINGTRAIN_ELASTIC_RESET_LIMIT"
    ELASTIC_JOIN = "RINGTRAIN_ELASTIC_JOIN"
    ELASTIC_MIN_NP = "RINGTRAIN_ELASTIC_MIN_NP"  # the fewest ranks the job goes on with


# Placement, not settings: Config.from_env skips them instead of calling them typos.
PLACEMENT_VARS = frozenset(
    v for k, v in vars(Ringtrain).items() if not k.startswith("_") and isinstance(v, str)
)


class Horovod:
    """What ``horovodrun`` sets per rank; ``ringtrain run`` writes the same, for Horovod scripts."""

    RANK = "HOROVOD_RANK"
    SIZE = "HOROVOD_SIZE"
    LOCAL_RANK = "HOROVOD_LOCAL_RANK"
    LOCAL_SIZE = "HOROVOD_LOCAL_SIZE"
    CROSS_RANK = "HOROVOD_CROSS_RANK"
    CROSS_SIZE = "HOROVOD_CROSS_SIZE"
    HOSTNAME = "HOROVOD_HOSTNAME"
    GLOO_RENDEZVOUS_ADDR = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
    GLOO_RENDEZVOUS_PORT = "HOROVOD_GLOO_RENDEZVOUS_PORT"
    CONTROLLER = "HOROVOD_CONTROLLER"
    CPU_OPERATIONS = "HOROVOD_CPU_OPERATIONS"


class HorovodDriver:
    """Horovod's knobs that a driver program reads (not its ranks)."""

    SPARK_START_TIMEOUT = "HOROVOD_SPARK_START_TIMEOUT"  # horovod.spark.run's start_timeout


class Torch:
    """torchrun's (and any env:// launcher's), torch.distributed's and its backends'."""

    RANK = "RANK"
    WORLD_SIZE = "WORLD_SIZE"
    LOCAL_RANK = "LOCAL_RANK"
    LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
    GROUP_RANK = "GROUP_RANK"
    NODE_RANK = "NODE_RANK"  # Ray Train, Lightning: the node's index
    GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
    ROLE_RANK = "ROLE_RANK"
    ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
    ROLE_NAME = "ROLE_NAME"
    MASTER_ADDR = "MASTER_ADDR"
    MASTER_PORT = "MASTER_PORT"
    TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
    TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
    TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
    TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
    TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
    # torch reads Gloo's interface only from this variable (set before the first group)
    GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
    # "1": a Gloo group connects a pair of ranks at their first exchange, not all pairs at once.
    GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
    NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
    CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
    # Which ATen CPU kernels (default, avx2, avx512) a process runs: read once, at its first kernel.
    ATEN_CPU_CAPABILITY = "ATEN_CPU_CAPABILITY"


class OpenMPI:
    """Open MPI's ``mpirun`` (and the MPI Operator's MPIJob, which runs it)."""

    RANK = "OMPI_COMM_WORLD_RANK"
    SIZE = "OMPI_COMM_WORLD_SIZE"
    LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
    LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
    JOB_ID = "OMPI_MCA_ess_base_jobid"
    # interfaces MPI's TCP transport must not use (written before MPI starts)
    TCP_IF_EXCLUDE = "OMPI_MCA_btl_tcp_if_exclude"
    TCP_IF_INCLUDE = "OMPI_MCA_btl_tcp_if_include"
    # mpirun, given SIGTERM, passes it on this many seconds later, and SIGKILL as long after
    SIGKILL_TIMEOUT = "OMPI_MCA_odls_base_sigkill_timeout"


class MPICH:
    """MPICH's and Intel MPI's ``mpiexec`` (PMI)."""

    RANK = "PMI_RANK"
    SIZE = "PMI_SIZE"
    LOCAL_RANK = "MPI_LOCALRANKID"
    LOCAL_SIZE = "MPI_LOCALNRANKS"


class Slurm:
    """``srun``'s task variables (and ``SLURM_CONF``, which the test Slurm writes)."""

    PROCID = "SLURM_PROCID"
    NTASKS = "SLURM_NTASKS"
    LOCALID = "SLURM_LOCALID"
    NODEID = "SLURM_NODEID"
    JOB_ID = "SLURM_JOB_ID"
    STEP_ID = "SLURM_STEP_ID"
    STEP_NODELIST = "SLURM_STEP_NODELIST"
    JOB_NODELIST = "SLURM_JOB_NODELIST"
    NODELIST = "SLURM_NODELIST"
    STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
    TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"
    CONF = "SLURM_CONF"


class Kubeflow:
    """The Kubeflow Training Operator's PyTorchJob/TrainJob pods (besides MASTER_*, RANK)."""

    MASTER_ADDR = "PET_MASTER_ADDR"
    MASTER_PORT = "PET_MASTER_PORT"
    NNODES = "PET_NNODES"
    NPROC_PER_NODE = "PET_NPROC_PER_NODE"
    NODE_RANK = "PET_NODE_RANK"


class KubeflowTrainer:
    """Kubeflow Trainer's progress endpoint, injected into a TrainJob's pods
    (:mod:`ringtrain.diagnostics.trainjob_status`)."""

    SERVER_URL = "KUBEFLOW_TRAINER_SERVER_URL"
    SERVER_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
    SERVER_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
    # The same three under their earlier names (the plugin was first called "Progress").
    STATUS_URL = "KUBEFLOW_TRAINER_STATUS_URL"
    STATUS_CA_CERT = "KUBEFLOW_TRAINER_STATUS_CA_CERT"
    STATUS_TOKEN = "KUBEFLOW_TRAINER_STATUS_TOKEN"


class Ray:
    """Ray's own, which the Ray test cluster sets for its nodes and drivers."""

    ADDRESS = "RAY_ADDRESS"
    AUTH_MODE = "RAY_AUTH_MODE"
    AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
    USAGE_STATS_ENABLED = "RAY_USAGE_STATS_ENABLED"
    WORKER_NICENESS = "RAY_worker_niceness"


class Threads:
    """Thread pools' settings: how many threads each rank starts, and where."""

    OMP_NUM_THREADS = "OMP_NUM_THREADS"
    MKL_NUM_THREADS = "MKL_NUM_THREADS"
    OPENBLAS_NUM_THREADS = "OPENBLAS_NUM_THREADS"
    OMP_PROC_BIND = "OMP_PROC_BIND"
    OMP_PLACES = "OMP_PLACES"
    KMP_AFFINITY = "KMP_AFFINITY"
    KMP_BLOCKTIME = "KMP_BLOCKTIME"
    GOMP_CPU_AFFINITY = "GOMP_CPU_AFFINITY"


class Process:
    """The interpreter's and the loader's own."""

    PATH = "PATH"
    PYTHONPATH = "PYTHONPATH"
    PYTHONHASHSEED = "PYTHONHASHSEED"
    PYTHONWARNINGS = "PYTHONWARNINGS"
    PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
    LD_LIBRARY_PATH = "LD_LIBRARY_PATH"
    LD_PRELOAD = "LD_PRELOAD"
    MALLOC_CONF = "MALLOC_CONF"
    VIRTUAL_ENV = "VIRTUAL_ENV"
    CONDA_PREFIX = "CONDA_PREFIX"
    LANG = "LANG"
    TZ = "TZ"


# What the doctor shows of a host's thread settings: they decide how many threads a rank starts.
THREAD_VARS = (
    *(v for k, v in vars(Threads).items() if not k.startswith("_")),
    Process.MALLOC_CONF,
    Process.LD_PRELOAD,
)

# What ``ringtrain run`` forwards to remote hosts by default (glob patterns); the rest needs -x.
FORWARDED = (
    Process.PATH,
    Process.PYTHONPATH,
    Process.PYTHONHASHSEED,
    Process.PYTHONWARNINGS,
    Process.PYTHONUNBUFFERED,
    Process.LD_LIBRARY_PATH,
    Process.VIRTUAL_ENV,
    Process.CONDA_PREFIX,
    Process.LANG,
    "LC_*",
    Process.TZ,
    "OMP_*",
    "MKL_*",
    "KMP_*",
    "NCCL_*",
    "GLOO_*",
    "TORCH_*",
    # ATen's kernels: set on the launcher, every host computes with the same ones (hosts whose
    # CPUs differ would otherwise pick their own, and the same job's weights differ in the
    # last bits between them).
    Torch.ATEN_CPU_CAPABILITY,
    Torch.CUDA_VISIBLE_DEVICES,
    "HF_*",
    PREFIX + "*",
    "HOROVOD_*",  # a Horovod job's knobs (mapped below); placement is rewritten
)


# ---- the process's environment: the one place that touches os.environ -------------------------


def current() -> Mapping[str, str]:
    """This process's environment, for reading (pass it on as ``env``)."""
    return os.environ


def mutable() -> MutableMapping[str, str]:
    """This process's environment, for a harness that sets and restores variables around a call."""
    return os.environ


def set_var(name: str, value: str) -> None:
    os.environ[name] = value


def setdefault(name: str, value: str) -> None:
    """Set ``name`` unless the user set it: their value wins."""
    os.environ.setdefault(name, value)


def update(values: Mapping[str, str]) -> None:
    os.environ.update(values)


def pop(name: str) -> None:
    os.environ.pop(name, None)


# Python logging levels, and Horovod's two extra names for the nearest one.
LOG_LEVELS = {
    "TRACE": "DEBUG",
    "DEBUG": "DEBUG",
    "INFO": "INFO",
    "WARNING": "WARNING",
    "ERROR": "ERROR",
    "FATAL": "CRITICAL",
    "CRITICAL": "CRITICAL",
}


# ---- Horovod's variables ------------------------------------------------------------------------
# A job whose environment was written for Horovod is configured the same way: each HOROVOD_* knob
# with a meaning here maps onto one Config field, in Horovod's unit. A RINGTRAIN_* twin set too
# wins (see from_env). Horovod parses with strtol/strtod and reads garbage as 0; we reject it.


def _hvd_number(kind: type, unit: str, positive: bool = False) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        value = kind(raw.strip())
        if value < 0 or (positive and value == 0):
            raise ValueError(raw)
        return value

    what = "an integer" if kind is int else "a number"
    parse.__doc__ = f"{what} of {unit}, {'> 0' if positive else '>= 0'}"
    return parse


def _hvd_bool(raw: str) -> bool:
    """0 or 1 (Horovod's own spelling; true/false/yes/no/on/off read too)."""
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _hvd_onoff(raw: str) -> str:
    """0 or 1"""
    return "on" if _hvd_bool(raw) else "off"


def _hvd_level(raw: str) -> str:
    """one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL"""
    if raw.strip().upper() not in LOG_LEVELS:
        raise ValueError(raw)
    return LOG_LEVELS[raw.strip().upper()]


def _hvd_timeline(raw: str) -> str:
    """a file name, or DYNAMIC (no file at init; hvd.start_timeline() starts one)"""
    return "" if raw.strip().upper() == "DYNAMIC" else raw


def _hvd_stall_disable(raw: str) -> float | None:
    """0 or 1"""
    return 0.0 if _hvd_bool(raw) else None  # 0 turns the inspector off; "0" changes nothing


@dataclass(frozen=True)
class HorovodVar:
    field: str
    parse: Callable[[str], Any]  # raises ValueError; None means "no change"


# The one table of Horovod variables that carry a meaning here. Order matters only where two
# feed one field: HOROVOD_STALL_CHECK_DISABLE=1 beats HOROVOD_STALL_CHECK_TIME_SECONDS.
HOROVOD_VARS: dict[str, HorovodVar] = {
    "HOROVOD_FUSION_THRESHOLD": HorovodVar("fusion_threshold_bytes", _hvd_number(int, "bytes")),
    "HOROVOD_CYCLE_TIME": HorovodVar(
        "cycle_time_ms", _hvd_number(float, "milliseconds", positive=True)
    ),
    "HOROVOD_CACHE_CAPACITY": HorovodVar("cache_capacity", _hvd_number(int, "requests")),
    "HOROVOD_TIMELINE": HorovodVar("timeline_filename", _hvd_timeline),
    "HOROVOD_HIERARCHICAL_ALLREDUCE": HorovodVar("hierarchical", _hvd_onoff),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": HorovodVar("stall_warning_s", _hvd_number(int, "seconds")),
    "HOROVOD_STALL_CHECK_DISABLE": HorovodVar("stall_warning_s", _hvd_stall_disable),
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": HorovodVar(
        "stall_shutdown_s", _hvd_number(int, "seconds")
    ),
    "HOROVOD_GLOO_IFACE": HorovodVar("network_interface", str.strip),
    # Horovod's timeout of every Gloo rendezvous and operation (horovodrun's
    # --gloo-timeout-seconds, which ringtrain run reads as --timeout).
    "HOROVOD_GLOO_TIMEOUT_SECONDS": HorovodVar(
        "timeout_s", _hvd_number(int, "seconds", positive=True)
    ),
    "HOROVOD_LOG_LEVEL": HorovodVar("log_level", _hvd_level),
}

# Horovod variables accepted without a meaning here, and why (``ringtrain run -v`` lists the
# ones set). Patterns are globs.
HOROVOD_UNUSED: dict[str, str] = {
    "HOROVOD_MPI_THREADS_DISABLE": "no MPI inside ringtrain",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "allgather is always flat",
    "HOROVOD_AUTOTUNE*": "no autotuner; compression='auto' measures and picks",
    "HOROVOD_TIMELINE_MARK_CYCLES": "the timeline has no cycle marks",
    "HOROVOD_LOG_HIDE_TIME": "Python logging formats ringtrain's log",
    "HOROVOD_NUM_NCCL_STREAMS": "NCCL knob; engine_streams sets concurrent buckets",
    "HOROVOD_GPU_*": "GPU operations are chosen by torch.distributed",
    "HOROVOD_NCCL_*": "NCCL knob",
    "HOROVOD_CCL_*": "no oneCCL",
    "HOROVOD_MLSL_*": "no MLSL",
    "HOROVOD_ADASUM_*": "no Adasum",
    "HOROVOD_THREAD_AFFINITY": "ranks are pinned by ringtrain run --bind-to",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "GPU-only",
    "HOROVOD_ENABLE_ASYNC_COMPLETION": "GPU-only",
    "HOROVOD_DISABLE_GROUP_FUSION": "grouped collectives are fused like any others",
    "HOROVOD_ELASTIC*": "use ringtrain run --elastic-timeout / --min-np (docs/elastic.md)",
    "HOROVOD_START_TIMEOUT": "use ringtrain run --start-timeout",
    "NCCL_*": "read by NCCL only: no effect on Gloo (CPU) jobs",
}

# horovodrun's --config-file (YAML): section -> key -> the variable horovodrun gives the ranks
# for it (horovod/runner/common/util/config_parser.py) and how it writes the value: "plain",
# "mib" (megabytes, written in bytes), "switch" (1/0), "switch_off" (0/1). launch/horovod_config
# reads a file through this table and HOROVOD_VARS.
HOROVOD_CONFIG_KEYS: dict[str, dict[str, tuple[str, str]]] = {
    "params": {
        "fusion_threshold_mb": ("HOROVOD_FUSION_THRESHOLD", "mib"),
        "cycle_time_ms": ("HOROVOD_CYCLE_TIME", "plain"),
        "cache_capacity": ("HOROVOD_CACHE_CAPACITY", "plain"),
        "hierarchical_allreduce": ("HOROVOD_HIERARCHICAL_ALLREDUCE", "switch"),
        "hierarchical_allgather": ("HOROVOD_HIERARCHICAL_ALLGATHER", "switch"),
    },
    "autotune": {
        "enabled": ("HOROVOD_AUTOTUNE", "switch"),
        "log_file": ("HOROVOD_AUTOTUNE_LOG", "plain"),
        "warmup_samples": ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "plain"),
        "steps_per_sample": ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "plain"),
        "bayes_opt_max_samples": ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "plain"),
        "gaussian_process_noise": ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "plain"),
    },
    "timeline": {
        "filename": ("HOROVOD_TIMELINE", "plain"),
        "mark_cycles": ("HOROVOD_TIMELINE_MARK_CYCLES", "switch"),
    },
    "stall_check": {
        "enabled": ("HOROVOD_STALL_CHECK_DISABLE", "switch_off"),
        "warning_time_seconds": ("HOROVOD_STALL_CHECK_TIME_SECONDS", "plain"),
        "shutdown_time_seconds": ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "plain"),
    },
    "library_options": {
        "mpi_threads_disable": ("HOROVOD_MPI_THREADS_DISABLE", "switch"),
        "num_nccl_streams": ("HOROVOD_NUM_NCCL_STREAMS", "plain"),
        "ccl_bgt_affinity": ("HOROVOD_CCL_BGT_AFFINITY", "plain"),
        "gloo_timeout_seconds": ("HOROVOD_GLOO_TIMEOUT_SECONDS", "plain"),
    },
    "logging": {
        "level": ("HOROVOD_LOG_LEVEL", "plain"),
        "with_timestamp": ("HOROVOD_LOG_HIDE_TIME", "switch"),
        # In Horovod's own example file; its parser reads with_timestamp only.
        "hide_timestamp": ("HOROVOD_LOG_HIDE_TIME", "switch"),
    },
}

# Set by a launcher (ringtrain run writes these itself) and read as placement, not settings.
# No HOROVOD_GLOO_* glob: HOROVOD_GLOO_TIMEOUT_SECONDS is a setting, and an unknown one is reported.
HOROVOD_PLACEMENT = tuple(
    v for k, v in vars(Horovod).items() if not k.startswith("_") and isinstance(v, str)
)


def horovod_vars_of(field: str) -> tuple[str, ...]:
    """The Horovod variables that set Config field ``field``."""
    return tuple(var for var, hv in HOROVOD_VARS.items() if hv.field == field)


def horovod_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """Config values that ``env``'s Horovod variables ask for (Horovod's units converted)."""
    out: dict[str, Any] = {}
    for var, hv in HOROVOD_VARS.items():
        raw = env.get(var)
        if raw is None:
            continue
        try:
            value = hv.parse(raw)
        except ValueError:
            raise ConfigError(
                f"{var}={raw!r} is not valid: expected {hv.parse.__doc__}.\n"
                f"HINT: it sets ringtrain's {hv.field} (also {setting_var(hv.field)})."
            ) from None
        if value is not None:
            out[hv.field] = value
    return out


def horovod_unused(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(variable, why)`` for every set Horovod/NCCL variable that has no effect here."""
    out = []
    for var in sorted(env):
        if var in HOROVOD_VARS or _matches(var, HOROVOD_PLACEMENT):
            continue
        why = next((w for p, w in HOROVOD_UNUSED.items() if fnmatch.fnmatchcase(var, p)), None)
        if why is None and var.startswith("HOROVOD_"):
            why = "not known to ringtrain"
        if why is not None:
            out.append((var, why))
    return out


def _matches(var: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(var, p) for p in patterns)
