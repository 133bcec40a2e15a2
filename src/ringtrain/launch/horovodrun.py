"""horovodrun's flags that ``ringtrain run`` does not carry out: each refused by name, with why.

``ringtrain run`` takes horovodrun's command lines (docs/horovod.md). Most of its flags have the
same meaning here (``launch/command.py`` declares them, some as second spellings: ``-hostfile``,
``--min-num-proc``, ``--gloo-timeout-seconds``); a few are accepted and not needed
(:data:`NOT_NEEDED`: one line says why). The rest are :data:`REFUSED`: argparse would say only
"unrecognized arguments", so each is declared and ends the parse with one line naming it and
saying why and what to do. :func:`table` renders the whole mapping from the parser itself, for
docs/horovod.md (``tests/launch/test_horovodrun_flags.py`` holds the page to it, and every flag
of Horovod's own parser to being accepted or refused by name).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

# Accepted; not needed here. One line each, printed when given.
NOT_NEEDED = {
    "gloo": "--gloo is not needed: ranks always talk over torch.distributed (Gloo on CPU)",
    "mpi": "--mpi is not needed: ringtrain run starts the ranks itself; to start them with "
    "mpirun instead, run `mpirun ... python train.py` (ringtrain reads Open MPI's variables)",
    "disable_cache": "--disable-cache is not needed: ringtrain run keeps no cache of host checks "
    "and checks every host on every start",
    "stall_check": "--stall-check is not needed: the stall check is on unless "
    "--stall-warning-time 0 (--no-stall-check) turns it off",
    "timeline_mark_cycles": "--timeline-mark-cycles is not needed: ringtrain's timeline has no "
    "cycles to mark (hvd.start_timeline's mark_cycles is accepted and ignored alike)",
    "log_without_timestamp": "--log-without-timestamp is not needed: ringtrain's log lines "
    "carry no timestamp",
}

# Accepted with another meaning than horovodrun's: the table says so.
DIFFERENT = {
    "-v": "ringtrain run's -v is --verbose; horovodrun's is --version (`ringtrain --version`)",
}

_NO_AUTOTUNE = (
    "ringtrain has no autotuner; compression='auto' and sync_every='auto' measure a few steps "
    "and pick (docs/engine.md), and the fusion knobs are set by hand"
)
_NO_MPI = "ringtrain run starts ranks itself, without MPI; start them with mpirun instead"

# horovodrun's flags that have no counterpart, and why.
REFUSED: dict[str, str] = {
    "--check-build": "ringtrain has no build options: every wheel has Gloo and, with CUDA, "
    "NCCL; `ringtrain doctor` checks what a job needs on every host",
    "-cb": "see --check-build",
    "--autotune": _NO_AUTOTUNE,
    "--no-autotune": "the default: ringtrain has no autotuner",
    "--autotune-log-file": _NO_AUTOTUNE,
    "--autotune-warmup-samples": _NO_AUTOTUNE,
    "--autotune-steps-per-sample": _NO_AUTOTUNE,
    "--autotune-bayes-opt-max-samples": _NO_AUTOTUNE,
    "--autotune-gaussian-process-noise": _NO_AUTOTUNE,
    "--hierarchical-allgather": "ringtrain's allgather is flat; --hierarchical applies to "
    "DistributedOptimizer's gradient buckets",
    "--no-hierarchical-allgather": "ringtrain's allgather is always flat (the default)",
    "--mpi-threads-disable": _NO_MPI,
    "--no-mpi-threads-disable": _NO_MPI,
    "--mpi-args": _NO_MPI,
    "--binding-args": "MPI's binding arguments; ringtrain run binds ranks itself (--bind-to)",
    "--jsrun": "ringtrain run does not start ranks through jsrun; run `jsrun ... python "
    "train.py` (ringtrain reads MPI's variables)",
    "--tcp": "ringtrain's Gloo traffic is TCP already; --transport tcp is ringtrain's own "
    "sockets for enclaves",
    "--num-nccl-streams": "ringtrain uses one NCCL stream per process group",
    "--thread-affinity": "ringtrain run pins whole ranks (--bind-to), not their threads",
    "--log-with-timestamp": "ringtrain's log lines carry no timestamp of their own; "
    "--prefix-output-with-timestamp stamps every line the ranks print, these among them",
    "--log-hide-timestamp": "deprecated in Horovod; ringtrain's log lines carry no timestamp",
    "--no-log-hide-timestamp": "deprecated in Horovod; ringtrain's log lines carry no timestamp",
    "--version": "ringtrain's version is `ringtrain --version` (in ringtrain run, -v is --verbose)",
}


class _Refuse(argparse.Action):
    """Ends the parse at a refused flag with one line naming it and saying why."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        flag = option_string or self.option_strings[0]
        parser.error(f"horovodrun's {flag} is not supported: {REFUSED[flag]}")


def add_refused(p: argparse.ArgumentParser) -> None:
    """Declare every refused flag (hidden from --help: docs/horovod.md lists them)."""
    for flag in REFUSED:
        p.add_argument(flag, nargs="?", action=_Refuse, help=argparse.SUPPRESS)


def add_not_needed(group: argparse._ArgumentGroup) -> None:
    for name in NOT_NEEDED:
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            action="store_true",
            help="accepted; not needed (a note says why)",
        )


def not_needed(args: argparse.Namespace) -> list[str]:
    """One line for each horovodrun flag given that ringtrain does not need."""
    return [line for name, line in NOT_NEEDED.items() if getattr(args, name, False)]


def table(p: argparse.ArgumentParser, flags: Sequence[str]) -> list[tuple[str, str]]:
    """``(flag, what ringtrain run does with it)`` for each of horovodrun's ``flags``, read from
    the parser ``p`` (``ringtrain run``'s): its option, a note, or the refusal."""
    by_flag = {s: a for a in p._actions for s in a.option_strings}
    rows = []
    for flag in flags:
        action = by_flag.get(flag)
        if flag in REFUSED:
            what = f"refused: {REFUSED[flag]}"
        elif flag in DIFFERENT:
            what = f"accepted, different: {DIFFERENT[flag]}"
        elif action is None:
            what = "unknown to ringtrain run"  # the test fails on such a row
        elif action.dest in NOT_NEEDED:
            what = "accepted, " + NOT_NEEDED[action.dest].split(": ", 1)[1]
        else:
            spellings = " / ".join(f"`{s}`" for s in action.option_strings)
            what = f"accepted: {spellings}"
        rows.append((flag, what))
    return rows
