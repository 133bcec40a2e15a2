"""``ringtrain pod-init -- COMMAND``: a container's first process that passes a SIGTERM on.

The kubelet stops a pod by sending SIGTERM to each container's first process (PID 1 of its
PID namespace) alone, and SIGKILL to every process in it once the pod's
``terminationGracePeriodSeconds`` is over. An MPIJob's worker pod runs sshd; the ranks that
Open MPI's daemon starts there over ssh are its sessions' descendants, which it does not signal.
sshd ends on the SIGTERM, and as the end of a PID namespace's first process kills every other
process in it, the ranks die at once, unsaved (tried by hand on the tests' namespace hosts).

As PID 1, this runs COMMAND and, on SIGTERM, sends SIGTERM to every other process of its PID
namespace (``kill(-1)``: the whole container), reaps them (orphans come to PID 1) and exits
once none is left, with COMMAND's exit code. Without a SIGTERM it exits when COMMAND does.
``ringtrain k8s`` writes it into a durable job's MPIJob worker pods (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import os
import signal

from ringtrain import environ
from ringtrain.errors import ConfigError

_STOPS = (signal.SIGTERM, signal.SIGINT)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the container's command (after --)"
    )


def main(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError(
            "no command given; write the container's command after it, "
            "e.g. ringtrain pod-init -- /usr/sbin/sshd -De"
        )
    if os.getpid() != 1:
        raise ConfigError(
            "it runs as a container's first process (PID 1), where every process it signals "
            f"is the container's; here it is pid {os.getpid()}. Make it the container's "
            "command, or run COMMAND directly"
        )
    return run(command)


def run(command: list[str]) -> int:
    """Start ``command``, pass SIGTERM/SIGINT on to every process (PID 1 only), reap all; the
    exit code is the command's (128 + signal where a signal ended it)."""
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)
        os.kill(-1, signum)  # every process this one may signal: the namespace's, but itself

    for signum in _STOPS:
        signal.signal(signum, stop)
    try:
        child = os.posix_spawnp(command[0], command, dict(environ.current()))
    except OSError as e:
        raise ConfigError(f"cannot start {command[0]!r}: {e}") from e
    if stopping:  # the SIGTERM came while it was starting
        os.kill(-1, stopping[0])
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, 0)  # retried after a signal's handler (PEP 475)
        except ChildProcessError:  # no process is left in the namespace but this one
            break
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            if not stopping:  # the command ended by itself: so does the container
                break
    if code is None:
        return 128 + stopping[0]
    return code if code >= 0 else 128 - code
