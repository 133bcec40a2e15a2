"""``ringtrain.run(func, ...)``: Horovod's ``horovod.run``, on ``ringtrain run``'s launcher.

Runs ``func(*args, **kwargs)`` in every rank of a job and returns the ranks' return values, in
rank order. Its parameters are ``horovod.run``'s, and each maps onto the horovodrun flag of the
same meaning, so the job is planned, checked, started and supervised exactly as
``ringtrain run`` would (same hosts, ssh, interfaces, failure report).

The function travels to the ranks by value (cloudpickle, as Horovod), base64 in the ranks'
command line, so it needs no shared file system: a function defined in a notebook or in
``__main__`` works. Each rank's return value comes back on one marked line of its stdout
(:data:`~ringtrain.launch.rank_output.RESULT_PREFIX`), which the launcher keeps instead of
printing. A job that fails raises :class:`~ringtrain.errors.JobFailedError` (a RuntimeError,
as Horovod's), after the launcher's report naming the rank that failed first; a durable job
that stopped on a preemption at a step it saved raises its subclass
:class:`~ringtrain.errors.JobPreemptedError`, which says how to continue.
"""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

from ringtrain.errors import ConfigError, JobFailedError, JobPreemptedError
from ringtrain.launch import code_files, command, job_state
from ringtrain.launch.supervisor import Supervisor

# Linux refuses a single argument over 128 KiB (MAX_ARG_STRLEN); leave room for the rest.
MAX_PAYLOAD = 100_000


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` on every rank; returns the results by rank.

    ``np``/``min_np``/``max_np`` are Horovod's older names of ``num_proc``/``min_num_proc``/
    ``max_num_proc``. ``use_mpi``/``mpi_args`` are refused (ringtrain's launcher starts ranks
    itself; under mpirun, start the script with mpirun instead).
    """
    if hosts is not None and hostfile is not None:
        raise ConfigError("ringtrain.run: give hosts or hostfile, not both")
    if use_mpi or mpi_args:
        raise ConfigError(
            "ringtrain.run: use_mpi/mpi_args are not supported: ringtrain's launcher starts the "
            "ranks itself (ssh, no MPI).\nHINT: drop them, or start the script with mpirun, "
            "which ringtrain's ranks also run under."
        )
    flags = _flags(
        num_proc=num_proc if num_proc is not None else np,
        min_np=min_num_proc if min_num_proc is not None else min_np,
        max_np=max_num_proc if max_num_proc is not None else max_np,
        slots=slots,
        reset_limit=reset_limit,
        cooldown_range=cooldown_range,
        hosts=hosts,
        hostfile=hostfile,
        start_timeout=start_timeout,
        ssh_port=ssh_port,
        ssh_identity_file=ssh_identity_file,
        disable_cache=disable_cache,
        output_filename=output_filename,
        verbose=verbose,
        network_interface=network_interface,
    )
    payload = _payload(func, args, kwargs)
    argv = [*flags, "--", executable or sys.executable, "-m", "ringtrain.launch.run_func"]
    parser = argparse.ArgumentParser(prog="ringtrain.run")
    command.configure(parser)
    try:
        options = command.checked_options(parser.parse_args([*argv, payload.decode()]))
    except SystemExit as e:  # argparse has printed what was wrong
        raise ConfigError(f"ringtrain.run: invalid arguments ({' '.join(flags)})") from e
    results: dict[int, Any] = {}

    def keep(rank: int, line: str) -> None:
        results[rank] = cloudpickle.loads(base64.b64decode(line))

    supervisor = Supervisor(options, on_result=keep)
    return _results(supervisor.run(), supervisor.state, results, options.np)


def _results(code: int, ended: job_state.State, results: dict[int, Any], np: int) -> list[Any]:
    """The ranks' results in rank order, or the error that says how the job ended instead."""
    if code != 0 and isinstance(ended, job_state.Done) and ended.preempted:
        raise JobPreemptedError(
            f"ringtrain.run: the job stopped on a preemption at the step it saved (exit code "
            f"{code}); nothing failed.\nHINT: to continue from that step, run it again with "
            "RINGTRAIN_RESUME set to its checkpoint directory.",
            code,
        )
    if code != 0:
        raise JobFailedError(
            f"ringtrain.run: the job failed with exit code {code}; the report above names the "
            "rank that failed first.",
            code,
        )
    missing = [r for r in range(np) if r not in results]
    if missing:
        raise JobFailedError(
            f"ringtrain.run: ranks {missing} exited 0 without returning a result (a rank that "
            "ends its process itself, os._exit or sys.exit(0), returns nothing).",
            1,
        )
    return [results[r] for r in range(np)]


def _flags(**given: Any) -> list[str]:
    """horovodrun's flags for ``horovod.run``'s parameters (None: not given)."""
    spell = {
        "num_proc": "-np",
        "min_np": "--min-np",
        "max_np": "--max-np",
        "slots": "--slots-per-host",
        "reset_limit": "--reset-limit",
        "hosts": "-H",
        "hostfile": "--hostfile",
        "start_timeout": "--start-timeout",
        "ssh_port": "--ssh-port",
        "ssh_identity_file": "--ssh-identity-file",
        "output_filename": "--output-filename",
        "network_interface": "--network-interface",
    }
    out: list[str] = []
    for name, value in given.items():
        if value is None or value is False:
            continue
        if name == "cooldown_range":
            out += ["--blacklist-cooldown-range", str(value[0]), str(value[1])]
        elif name == "disable_cache":
            continue  # ringtrain checks hosts at every start; nothing is cached
        elif name == "verbose":
            out.append("--verbose")
        else:
            out += [spell[name], str(value)]
    return out


def _payload(func: object, args: Sequence[object], kwargs: Mapping[str, object] | None) -> bytes:
    """What the ranks' command line carries: the call, and the function's files (code_files)."""
    sent = (func, tuple(args), dict(kwargs or {}), code_files.files_of(func))
    payload = base64.b64encode(cloudpickle.dumps(sent))
    if len(payload) > MAX_PAYLOAD:
        raise ConfigError(
            f"ringtrain.run: the function and its arguments pickle to {len(payload)} bytes "
            f"(base64), more than a command line carries ({MAX_PAYLOAD}).\nHINT: pass paths "
            "or small values, and load large data inside the function."
        )
    return payload
