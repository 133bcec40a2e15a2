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

from ringtrain import environ
from ringtrain.environ import Horovod, Process, Ringtrain
from ringtrain.launch.plan import ProcessSpec

# Forwarded to remote hosts by default (glob patterns). Everything else needs -x.
FORWARDED = environ.FORWARDED


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
        (Ringtrain.RANK, Horovod.RANK): spec.rank,
        (Ringtrain.SIZE, Horovod.SIZE): spec.size,
        (Ringtrain.LOCAL_RANK, Horovod.LOCAL_RANK): spec.local_rank,
        (Ringtrain.LOCAL_SIZE, Horovod.LOCAL_SIZE): spec.local_size,
        (Ringtrain.CROSS_RANK, Horovod.CROSS_RANK): spec.cross_rank,
        (Ringtrain.CROSS_SIZE, Horovod.CROSS_SIZE): spec.cross_size,
    }
    env = {var: str(v) for names, v in numbers.items() for var in names}
    env.update(
        {
            Ringtrain.HOSTNAME: spec.host,
            Ringtrain.RENDEZVOUS_ADDR: rdzv.addr,
            Ringtrain.RENDEZVOUS_PORT: str(rdzv.port),
            Ringtrain.RENDEZVOUS_HOSTED: "1",
            Ringtrain.JOB_ID: rdzv.job_id,
            Horovod.HOSTNAME: spec.host,
            Horovod.GLOO_RENDEZVOUS_ADDR: rdzv.addr,
            Horovod.GLOO_RENDEZVOUS_PORT: str(rdzv.port),
            Horovod.CONTROLLER: "gloo",
            Horovod.CPU_OPERATIONS: "gloo",
            # Output arrives line by line, prefixed with the rank, instead of in late blocks.
            Process.PYTHONUNBUFFERED: "1",
        }
    )
    return env
