"""Where a burst's wall time goes: Horovod's usual pattern (``count`` named ``allreduce_async_``
of 64 KiB, then ``synchronize`` each) cut into segments from the timeline, beside one raw
``torch.distributed.all_reduce`` of the same bytes, alternated in the same processes.

Each rank records a timeline (:mod:`ringtrain.diagnostics.timeline`) and marks its own
submissions; afterwards it reads its file back and prints, per burst (medians over the samples):
the wall time; the caller's submissions; how long after the first submission the first round
with work began, and the rounds with work (``NEGOTIATE``); the fused ops (``ALLREDUCE``: packing,
the wire, unpacking), the first one's start; the tail, from the last fused op's end to the
caller's last ``synchronize``; and the caller's CPU per submission (its thread's). The timeline costs a few microseconds an event, so the burst runs
slightly slower than without it: read the segments against each other and against the raw op.

    OMP_NUM_THREADS=1 .venv/bin/ringtrain run -np 2 -- .venv/bin/python \
        scripts/bench_burst_wall.py --count 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import ringtrain.torch as hvd
from ringtrain.collectives import execute
from ringtrain.diagnostics import timeline

NUMEL = 16384  # 64 KiB of float32
TRACK = "burst"


def _segments(events: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per burst (this script's ``BURST`` and ``SUBMIT`` spans): its segments in ms."""
    spans = [e for e in events if e.get("ph") == "X" and e["name"] in ("NEGOTIATE", "ALLREDUCE")]
    marks = [e for e in events if e.get("ph") == "X" and e["name"] in ("BURST", "SUBMIT")]
    bursts = [e for e in marks if e["name"] == "BURST"]
    submits = [e for e in marks if e["name"] == "SUBMIT"]
    out: dict[str, list[float]] = {}
    for burst, submit in zip(bursts, submits):
        t0, t1, t2 = burst["ts"], submit["ts"] + submit["dur"], burst["ts"] + burst["dur"]
        mine = [e for e in spans if t0 <= e["ts"] <= t2]
        rounds = [e for e in mine if e["name"] == "NEGOTIATE"]
        fused = [e for e in mine if e["name"] == "ALLREDUCE"]
        row = {
            "wall": t2 - t0,
            "submit": t1 - t0,
            "first round at": (rounds[0]["ts"] - t0) if rounds else float("nan"),
            "rounds": len(rounds) * 1000.0,  # a count: undone by the ms scaling below
            "in rounds": sum(e["dur"] for e in rounds),
            "fused ops": len(fused) * 1000.0,
            "first fused at": (fused[0]["ts"] - t0) if fused else float("nan"),
            "in fused ops": sum(e["dur"] for e in fused),
            "tail": (t2 - max(e["ts"] + e["dur"] for e in fused)) if fused else float("nan"),
        }
        for key, value in row.items():
            out.setdefault(key, []).append(value / 1000.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=256, help="async ops per burst")
    parser.add_argument("--samples", type=int, default=20, help="bursts timed per case")
    parser.add_argument("--chunk-mib", type=float, help="the fused path's pipeline chunk")
    args = parser.parse_args()
    if args.chunk_mib:
        execute.PIPELINE_CHUNK_BYTES = int(args.chunk_mib * 1024 * 1024)
    hvd.init()
    parts = [torch.ones(NUMEL) for _ in range(args.count)]
    whole = torch.ones(NUMEL * args.count)
    for _ in range(5):  # warm: every name cached, the buffers made
        handles = [hvd.allreduce_async_(t, name=f"b.{i}", op=hvd.Sum) for i, t in enumerate(parts)]
        for h in handles:
            hvd.synchronize(h)
        dist.all_reduce(whole)
    folder = tempfile.mkdtemp(prefix="burst-wall-")
    path = os.path.join(folder, f"trace.rank{hvd.rank()}.json")
    rec = timeline.start(path, hvd.rank())
    raw: list[float] = []
    submit_cpu: list[float] = []  # the caller's CPU per submission, us
    for _ in range(args.samples):
        hvd.barrier()
        time.sleep(0.02)
        c0, t0 = time.thread_time(), time.perf_counter()
        handles = [hvd.allreduce_async_(t, name=f"b.{i}", op=hvd.Sum) for i, t in enumerate(parts)]
        t1 = time.perf_counter()
        submit_cpu.append((time.thread_time() - c0) / args.count * 1e6)
        for h in handles:
            hvd.synchronize(h)
        t2 = time.perf_counter()
        rec.span(TRACK, "SUBMIT", t0, t1)
        rec.span(TRACK, "BURST", t0, t2)
        hvd.barrier()
        time.sleep(0.02)
        t0 = time.perf_counter()
        dist.all_reduce(whole)
        raw.append((time.perf_counter() - t0) * 1e3)
    timeline.stop()
    seg = _segments(timeline.load(path))
    os.remove(path)
    os.rmdir(folder)
    one = statistics.median(raw)
    wall = statistics.median(seg["wall"])
    cells = ", ".join(
        f"{k} {statistics.median(v):.0f}"
        if k in ("rounds", "fused ops")
        else f"{k} {statistics.median(v):.2f}"
        for k, v in seg.items()
    )
    print(
        f"rank {hvd.rank()}: {hvd.size()} ranks, {args.count} x 64 KiB, medians of {args.samples}: "
        f"one raw tensor {one:.2f} ms; burst {wall / one:.2f}x of it: {cells} (ms); the "
        f"caller's CPU per submission {statistics.median(submit_cpu):.1f} us",
        flush=True,
    )
    hvd.shutdown()


if __name__ == "__main__":
    main()
