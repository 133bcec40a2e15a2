"""The ``ringtrain`` command: a thin dispatcher over the library.

Each subcommand lives with the part it drives and exposes two functions::

    configure(parser: argparse.ArgumentParser) -> None   # add its flags
    main(args: argparse.Namespace) -> int                 # run, return the exit code

Subcommand modules are imported only when chosen, so ``ringtrain run`` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from ringtrain import __version__
from ringtrain.errors import RingtrainError

# name -> (module, one-line help). The module provides configure() and main().
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("ringtrain.launch.command", "start, supervise and clean up a job's ranks"),
    "bench": ("ringtrain.bench.command", "measure collectives and training throughput"),
    "doctor": ("ringtrain.doctor.command", "pre-flight check of hosts and links"),
    "k8s": (
        "ringtrain.deploy.command",
        "write Kubernetes manifests (PyTorchJob, MPIJob, TrainJob)",
    ),
    "pod-init": (
        "ringtrain.deploy.pod_init",
        "a container's first process: pass the pod's SIGTERM on to every process in it",
    ),
}


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: a flag it does not know is its own error, shown with its usage.

    Left to argparse, a subparser hands unknown flags up to the top-level parser, whose usage
    lists only the subcommands. Flags after ``ringtrain run``'s COMMAND are the command's
    (REMAINDER): they never reach this check."""

    # typeshed overloads the namespace's type; this keeps argparse's behaviour for every one.
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(
                f"unrecognized arguments: {' '.join(extras)}\n"
                f"HINT: `{self.prog} --help` lists the flags it takes."
            )
        return parsed, extras


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringtrain",
        description="Distributed data-parallel training for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"ringtrain {__version__}")
    sub = parser.add_subparsers(
        dest="subcommand", metavar="SUBCOMMAND", required=True, parser_class=_SubcommandParser
    )
    # Only the chosen subcommand's module is imported; the others show their one-line help.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).configure(sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # Ctrl-C while the subcommand's modules import (seconds, with torch) is no traceback
        args = build_parser(argv).parse_args(argv)
        module = importlib.import_module(SUBCOMMANDS[args.subcommand][0])
        try:
            return int(module.main(args))
        except RingtrainError as exc:
            print(f"ringtrain {args.subcommand}: error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
