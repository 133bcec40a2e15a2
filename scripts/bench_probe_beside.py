"""What the link probe reads on loopback alone and beside inner steps (issue 40).

A bare or auto ``sync_every``'s link probe (``ringtrain.engine.auto.probe_link``) runs on the
outer exchange's worker beside the first round's inner steps. This measures, on 2 loopback
ranks, the probe's (latency, bytes per second) alone, beside a thread running a tiny model's
Adam steps (Python-bound: it holds the GIL), and beside a thread of 256x256 matmuls (torch
releases the GIL), alternated ``--rounds`` times; and whether each reading would stand
beside the steps (``local_defaults.beside_stands``) for the ``--params`` model. One line per
reading, from rank 0. Run::

    .venv/bin/python scripts/bench_probe_beside.py --rounds 4
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable

import torch

from ringtrain.testing import spawn


def _adam_steps(stop: threading.Event) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    while not stop.is_set():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _matmuls(stop: threading.Event) -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


BESIDE: dict[str, Callable[[threading.Event], None] | None] = {
    "alone": None,
    "adam": _adam_steps,
    "matmul": _matmuls,
}


def _readings(rounds: int, grad_bytes: int) -> list[tuple[str, float, float, bool]]:
    from ringtrain.engine import auto, local_defaults
    from ringtrain.runtime import state

    group = state.current().world.communicator.group("engine")
    out = []
    for _ in range(rounds):
        for name, work in BESIDE.items():
            stop = threading.Event()
            worker = threading.Thread(target=work, args=(stop,)) if work else None
            if worker:
                worker.start()
            try:
                latency, rate = auto.probe_link(group, grad_bytes)
            finally:
                stop.set()
                if worker:
                    worker.join()
            out.append((name, latency, rate, local_defaults.beside_stands(grad_bytes, rate)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--params", type=int, default=1_300_000, help="the model's float32 count")
    args = ap.parse_args()
    world = spawn.world(2)
    try:
        readings = world.run(_readings, args.rounds, args.params * 4, timeout=600)[0]
    finally:
        spawn.close_all()
    print(f"probe_link on 2 loopback ranks, a model of {args.params:,} float32 parameters")
    print("beside  latency ms  MB/s  stands beside the steps")
    for name, latency, rate, stands in readings:
        print(f"{name:7} {latency * 1e3:10.3f} {rate / 1e6:6.0f}  {'yes' if stands else 'no'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
