"""A/B of the sealed collectives' small-exchange rounds: ring only vs direct rounds.

``ringtrain.transport.ring.SMALL_EXCHANGE_BYTES`` decides when a sealed exchange takes one
direct round instead of a ring; 0 turns direct rounds off (the ring for every size, as before
they existed). Each repeat runs one phase per setting, in alternating order; a phase is a fresh
secure ``ringtrain.init`` (so every rank's controller switches at the same moment) followed by
every size. Per size: ``torch.distributed.all_reduce`` on the sealed default group ("sealed")
and ``ringtrain.allreduce_`` in secure mode ("rt-secure"), the slowest rank's time per op.

    .venv/bin/python scripts/bench_sealed_exchange.py [--repeats 7]          # 2 ranks here
    ringtrain run --secure -H h0:1,h1:1,h2:1,h3:1 -- python scripts/bench_sealed_exchange.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)
SETTINGS = {"ring": 0, "direct": 1 << 20}


def measure(args: tuple[int, str]) -> str:
    """On every rank (ringtrain initialized); the report, the same on every rank."""
    import torch
    import torch.distributed as dist

    import ringtrain
    from ringtrain.runtime import state
    from ringtrain.transport import ring as sealed

    repeats, key_file = args
    base = state.current().config.replace(secure=True)
    if key_file:
        base = base.replace(key_file=key_file)
    n = ringtrain.size()
    local: dict[tuple[str, str, int], list[float]] = {}
    for rep in range(repeats):
        for setting in SETTINGS if rep % 2 == 0 else list(SETTINGS)[::-1]:
            ringtrain.shutdown()
            sealed.SMALL_EXCHANGE_BYTES = SETTINGS[setting]
            ringtrain.init(config=base)
            for nbytes in SIZES:
                t = torch.zeros(nbytes // 4)
                iters = max(1, min(50, (4 << 20) // nbytes))
                ops: dict[str, Any] = {
                    "sealed": lambda t=t: dist.all_reduce(t),
                    "rt-secure": lambda t=t, k=nbytes: ringtrain.allreduce_(
                        t, name=f"ab.{k}", op=ringtrain.Sum
                    ),
                }
                for name, op in ops.items():
                    op()  # warm-up: this phase's groups are new
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        op()
                    local.setdefault((name, setting, nbytes), []).append(
                        (time.perf_counter() - t0) / iters
                    )
    keys = sorted(local)
    slowest = torch.tensor([x for k in keys for x in local[k]], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = slowest.tolist()
    got = {k: values[i * repeats : (i + 1) * repeats] for i, k in enumerate(keys)}
    lines = [
        f"{n} ranks, {repeats} phases per setting, load average {os.getloadavg()[0]:.2f}; "
        "ms per op median [min-max] and bus bandwidth"
    ]
    for nbytes in SIZES:
        for name in ("sealed", "rt-secure"):
            cells = []
            for setting in SETTINGS:
                xs = got[(name, setting, nbytes)]
                m = statistics.median(xs)
                busbw = 2 * (n - 1) / n * nbytes / m / 1e6
                cells.append(
                    f"{setting} {m * 1e3:.2f} [{min(xs) * 1e3:.2f}-{max(xs) * 1e3:.2f}] "
                    f"{busbw:.0f} MB/s"
                )
            ring = statistics.median(got[(name, "ring", nbytes)])
            direct = statistics.median(got[(name, "direct", nbytes)])
            lines.append(
                f"{nbytes >> 10:5d} KiB {name:9s} | "
                + " | ".join(cells)
                + f" | ring/direct time {ring / direct:.2f}x"
            )
    return "\n".join(lines)


def main() -> None:
    from ringtrain.bench import ranks
    from ringtrain.security import keys

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("-np", type=int, default=2, help="ranks to spawn without a launcher")
    args = p.parse_args()
    if ranks.under_launcher():  # `ringtrain run --secure`: the launcher's key
        out = ranks.run(
            measure, (args.repeats, ""), np=None, threads=None, settings={}, timeout_s=900
        )
    else:
        with tempfile.TemporaryDirectory() as tmp:
            key = keys.write_key_file(os.path.join(tmp, "job.key"), keys.generate_job_key())
            out = ranks.run(
                measure, (args.repeats, key), np=args.np, threads=None, settings={}, timeout_s=900
            )
    if out:
        print(out)


if __name__ == "__main__":
    main()
