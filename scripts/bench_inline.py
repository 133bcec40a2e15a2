"""Small collectives with and without the inline path (data carried in the negotiation round).

Alternates the two settings in the same ranks (inline.INLINE_MAX_BYTES at its default, or 0),
5 repeats, each sample from a quiet process after a barrier; prints the median [min-max] of the
slowest rank's time per op. Run under the launcher:

    ringtrain run -np 2 -- .venv/bin/python scripts/bench_inline.py
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

import ringtrain as rt
from ringtrain.bench.models import get_preset
from ringtrain.bench.timing import seconds_per_op
from ringtrain.collectives import inline

REPEATS = 5


def main() -> None:
    rt.init()
    model = get_preset("transformer-25m").build()
    obj = {"lr": 0.1, "epochs": 10, "name": "run"}
    cases = {
        "broadcast_object (small dict)": (lambda: rt.broadcast_object(obj, 0), 20),
        "broadcast_parameters (transformer-25m)": (
            lambda: rt.broadcast_parameters(model.state_dict(), 0),
            1,
        ),
        "allgather_object (small tuple)": (lambda: rt.allgather_object(("r", rt.rank())), 20),
        "allreduce 1 KiB": (lambda: rt.allreduce(torch.ones(256), name="k"), 20),
    }
    settings = {"inline": inline.INLINE_MAX_BYTES, "collective": 0}
    times: dict[tuple[str, str], list[float]] = {}
    for rep in range(REPEATS):
        for label in settings if rep % 2 == 0 else list(settings)[::-1]:
            inline.INLINE_MAX_BYTES = settings[label]
            for case, (op, iters) in cases.items():
                t = torch.tensor([seconds_per_op(op, iters)], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.setdefault((case, label), []).append(t.item() * 1e3)
    if rt.rank() == 0:
        for case in cases:
            row = [case]
            for label in settings:
                v = times[(case, label)]
                row.append(f"{label} {statistics.median(v):.2f} ms [{min(v):.2f}-{max(v):.2f}]")
            print("  ".join(row))
    rt.shutdown()


if __name__ == "__main__":
    main()
