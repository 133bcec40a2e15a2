"""The environment every rank gets: placement, rendezvous, settings and forwarded variables.

Two sets of placement variables are written: ``RINGTRAIN_*`` (read by
:mod:`ringtrain.runtime.environment`) and the ones ``horovodrun`` sets, so scripts that read
``HOROVOD_RANK`` and friends keep working. Local ranks inherit the launcher's whole environment;
remote ranks get only the declared set below plus ``-x`` names, because a laptop's environment
rarely makes sense on a cluster node.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringtrain.launch.plan import ProcessSpec

# Forwarded to remote hosts by default (glob patterns). Everything else needs -x.
FORWARDED = (
    "PATH",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONWARNINGS",
    "PYTHONUNBUFFERED",
    "LD_LIBRARY_PATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "LANG",
    "LC_*",
    "TZ",
    "OMP_*",
    "MKL_*",
    "KMP_*",
    "NCCL_*",
    "GLOO_*",
    "TORCH_*",
    "CUDA_VISIBLE_DEVICES",
    "HF_*",
    "RINGTRAIN_*",
    "HOROVOD_*",  # a Horovod job's knobs (ringtrain.config maps them); placement is rewritten
)


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int
    job_id: str


def forwarded(env: Mapping[str, str], extra: Sequence[str]) -> dict[str, str]:
    """The variables sent to remote hosts: the declared set, plus ``-x VAR`` / ``-x VAR=value``."""
    out = {k: v for k, v in env.items() if any(fnmatch.fnmatchcase(k, p) for p in FORWARDED)}
    out.update(explicit(env, extra))
    return out


def explicit(env: Mapping[str, str], extra: Sequence[str]) -> dict[str, str]:
    """Just the ``-x`` variables (``-x VAR`` takes the launcher's value; unset ones are skipped)."""
    out = {}
    for item in extra:
        name, sep, value = item.partition("=")
        if sep:
            out[name] = value
        elif name in env:
            out[name] = env[name]
    return out


def placement(spec: ProcessSpec, rdzv: Rendezvous) -> dict[str, str]:
    """Placement and rendezvous variables of one rank, in both spellings."""
    numbers = {
        "RANK": spec.rank,
        "SIZE": spec.size,
        "LOCAL_RANK": spec.local_rank,
        "LOCAL_SIZE": spec.local_size,
        "CROSS_RANK": spec.cross_rank,
        "CROSS_SIZE": spec.cross_size,
    }
    env = {f"RINGTRAIN_{k}": str(v) for k, v in numbers.items()}
    env.update({f"HOROVOD_{k}": str(v) for k, v in numbers.items()})
    env.update(
        {
            "RINGTRAIN_HOSTNAME": spec.host,
            "RINGTRAIN_RENDEZVOUS_ADDR": rdzv.addr,
            "RINGTRAIN_RENDEZVOUS_PORT": str(rdzv.port),
            "RINGTRAIN_RENDEZVOUS_HOSTED": "1",
            "RINGTRAIN_JOB_ID": rdzv.job_id,
            "HOROVOD_HOSTNAME": spec.host,
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rdzv.addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rdzv.port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            # Output arrives line by line, prefixed with the rank, instead of in late blocks.
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env
