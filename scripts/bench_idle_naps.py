"""Rounds, wall time and CPU per op of a named allreduce in a loop, at N ranks on this machine.

Three loops: a 4 KiB op back to back ("loop"), the same out of phase ("phase": rank r sleeps 2r
ms before each op, so every op waits for the last rank), and a 64 KiB op back to back with the
fast lane off ("64k": every op takes a round, which is what the vector round's cost shows in).
Prints one JSON line: {kind: [rounds per op, ms per op (worst rank), CPU ms per op (mean
rank)]}. To compare two trees in one sitting, alternate runs with ``PYTHONPATH=<other
tree>/src`` (docs/benchmarks/log/2026-11-28-idle-naps.md).

    .venv/bin/python scripts/bench_idle_naps.py 4
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ringtrain.testing import spawn

LOOPS = {"loop": (1024, 100, True), "phase": (1024, 40, True), "64k": (16384, 200, False)}


def _loop(kind: str) -> tuple[float, float, float]:
    import psutil

    import ringtrain
    from ringtrain.collectives.ops import controller_of

    numel, ops, _ = LOOPS[kind]
    ctl = controller_of(None)
    t = torch.ones(numel)
    for _ in range(3):
        ringtrain.allreduce(t, name="loop")
    me = psutil.Process()
    cpu = sum(me.cpu_times()[:2])
    before, started = ctl.rounds, time.perf_counter()
    for _ in range(ops):
        if kind == "phase":
            time.sleep(0.002 * ringtrain.rank())
        ringtrain.allreduce(t, name="loop")
    wall = (time.perf_counter() - started) / ops * 1e3
    return (ctl.rounds - before) / ops, wall, (sum(me.cpu_times()[:2]) - cpu) / ops * 1e3


def main(size: int) -> None:
    world = spawn.World(size)
    out = {}
    try:
        for kind, (_, _, lane) in LOOPS.items():
            got = world.run(_loop, kind, timeout=200, fast_lane=lane)
            rounds = max(r for r, _, _ in got)
            out[kind] = [rounds, max(w for _, w, _ in got), sum(c for _, _, c in got) / size]
    finally:
        world.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
