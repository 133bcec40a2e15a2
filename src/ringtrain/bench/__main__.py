"""``python -m ringtrain.bench ARGS`` is ``ringtrain bench ARGS``: the form to give a launcher.

ringtrain run -np 2 -H h0:1,h1:1 -- python -m ringtrain.bench train --model cnn

It parses and reports errors as ``ringtrain`` does, without importing the ``ringtrain`` command
(:mod:`ringtrain.cli`), which sits above every subcommand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ringtrain.bench import command
from ringtrain.errors import RingtrainError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ringtrain bench", description="measure collectives and training throughput"
    )
    command.configure(parser)
    args = parser.parse_args(argv)
    try:
        return int(command.main(args))
    except RingtrainError as exc:
        print(f"ringtrain bench: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
