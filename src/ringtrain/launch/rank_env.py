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


def placement(spec: ProcessSpec, rdzv: Rendezvous, hosted: bool = True) -> dict[str, str]:
    """Placement and rendezvous variables of one rank, in both spellings. ``hosted``: the
    store at the rendezvous address is served by the launcher (else rank 0 serves it)."""
    env = variables(
        spec.rank,
        spec.size,
        rdzv.addr,
        rdzv.port,
        hosted=hosted,
        local=(spec.local_rank, spec.local_size),
        cross=(spec.cross_rank, spec.cross_size),
        host=spec.host,
        horovod=True,
    )
    env.update(
        {
            Ringtrain.JOB_ID: rdzv.job_id,
            Horovod.CONTROLLER: "gloo",
            Horovod.CPU_OPERATIONS: "gloo",
            # Output arrives line by line, prefixed with the rank, instead of in late blocks.
            Process.PYTHONUNBUFFERED: "1",
        }
    )
    return env


def variables(
    rank: int,
    size: int,
    addr: str,
    port: int | str,
    *,
    hosted: bool = True,
    local: tuple[int, int] | None = None,
    cross: tuple[int, int] | None = None,
    host: str | None = None,
    horovod: bool = False,
) -> dict[str, str]:
    """The placement variables of one rank: the one function that writes them, for every
    front end that starts ranks (``ringtrain run``, Ray, Spark, the test harness, the
    benchmarks; ``tests/launch/test_rank_env.py`` holds that). ``local``/``cross``: (rank,
    size) where the front end knows them (else ringtrain measures the placement);
    ``horovod``: also horovodrun's spellings, for scripts that read ``HOROVOD_RANK``."""
    numbers: dict[tuple[str, str], int] = {
        (Ringtrain.RANK, Horovod.RANK): rank,
        (Ringtrain.SIZE, Horovod.SIZE): size,
    }
    if local is not None:
        numbers[(Ringtrain.LOCAL_RANK, Horovod.LOCAL_RANK)] = local[0]
        numbers[(Ringtrain.LOCAL_SIZE, Horovod.LOCAL_SIZE)] = local[1]
    if cross is not None:
        numbers[(Ringtrain.CROSS_RANK, Horovod.CROSS_RANK)] = cross[0]
        numbers[(Ringtrain.CROSS_SIZE, Horovod.CROSS_SIZE)] = cross[1]
    env = {ours: str(v) for (ours, _), v in numbers.items()}
    env[Ringtrain.RENDEZVOUS_ADDR] = addr
    env[Ringtrain.RENDEZVOUS_PORT] = str(port)
    env[Ringtrain.RENDEZVOUS_HOSTED] = "1" if hosted else "0"
    if host is not None:
        env[Ringtrain.HOSTNAME] = host
    if horovod:
        env.update({theirs: str(v) for (_, theirs), v in numbers.items()})
        env[Horovod.GLOO_RENDEZVOUS_ADDR] = addr
        env[Horovod.GLOO_RENDEZVOUS_PORT] = str(port)
        if host is not None:
            env[Horovod.HOSTNAME] = host
    return env
