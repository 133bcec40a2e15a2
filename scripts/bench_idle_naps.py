"""Rounds and wall time per op of a named allreduce in a loop, at N ranks on this machine.

Two loops: back to back ("loop"), and out of phase ("phase": rank r sleeps 2r ms before each
op, so every op waits for the last rank). Prints one JSON line: {kind: [rounds per op, ms per
op]}, the worst rank's. To compare two trees in one sitting, alternate runs with
``PYTHONPATH=<other tree>/src`` (docs/benchmarks/log/2026-11-28-idle-naps.md).

    .venv/bin/python scripts/bench_idle_naps.py 4
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ringtrain.testing import spawn


def _loop(kind: str, ops: int) -> tuple[float, float]:
    import ringtrain
    from ringtrain.collectives.ops import controller_of

    ctl = controller_of(None)
    t = torch.ones(1024)
    ringtrain.allreduce(t, name="warm")
    before, started = ctl.rounds, time.perf_counter()
    for _ in range(ops):
        if kind == "phase":
            time.sleep(0.002 * ringtrain.rank())
        ringtrain.allreduce(t, name="loop")
    return (ctl.rounds - before) / ops, (time.perf_counter() - started) / ops * 1e3


def main(size: int) -> None:
    world = spawn.World(size)
    out = {}
    try:
        for kind, ops in (("loop", 100), ("phase", 40)):
            got = world.run(_loop, kind, ops, timeout=120)
            out[kind] = [max(r for r, _ in got), max(ms for _, ms in got)]
    finally:
        world.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
