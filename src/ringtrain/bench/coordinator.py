"""``ringtrain bench coordinator``: what a negotiation round costs at N ranks, in one process.

The real controller of one rank over a simulated wire (:mod:`ringtrain.collectives.simulated`),
gathered and vector rounds side by side in one run, idle and carrying cached ops: Python per
round on this rank, control bytes into it, collectives, sequential steps, messages decoded. No
ranks are spawned, so ``-np`` and the launcher play no part; the Python times are this process's
on whatever else the machine runs (the counts are exact).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from ringtrain.collectives import simulated
from ringtrain.config import check_path
from ringtrain.errors import ConfigError


def _numbers(text: str, flag: str, least: int) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < least:
        raise ConfigError(
            f"{flag} takes whole numbers of at least {least}, comma separated; got {text!r}"
        )
    return values


def main(args: argparse.Namespace) -> int:
    sizes = _numbers(args.ranks, "--ranks", 1)
    ops = _numbers(args.ops, "--ops", 0)
    if args.rounds < 1:
        raise ConfigError(f"--rounds must be at least 1, got {args.rounds}")
    if args.json:  # before the rounds run, not a traceback after them
        check_path(f"--json {args.json}", args.json)
    rows = simulated.figures(sizes, ops, args.rounds)
    print(simulated.table(rows), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "coordinator", "rows": [dataclasses.asdict(r) for r in rows]},
                      f, indent=2)  # fmt: skip
            f.write("\n")
    return 0
