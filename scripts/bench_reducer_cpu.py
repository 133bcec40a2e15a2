"""CPU time per step of the top-k and PowerSGD reducers, this tree against an earlier revision.

Both revisions' ``compression/topk.py`` and ``compression/powersgd.py`` run side by side in the
same ranks, interleaved step by step (the order flips every step), on transformer-25m's
gradient shapes packed into 64 MiB buckets as the engine packs them (two buckets, 15.8M and
9.5M entries), with random gradients: top-k at 1%, PowerSGD at rank 2 from its first step. A
sample is one step's ``reduce()`` calls for both buckets, in CPU seconds of the calling thread's
process (``time.process_time``), taken after a barrier. Ranks talk over loopback, one torch
thread each. Prints the median and min-max per reducer and rank, and the load average.

    .venv/bin/python scripts/bench_reducer_cpu.py --against 763d680 [--np 2] [--steps 8]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
FILES = {
    "topk": "src/ringtrain/compression/topk.py",
    "powersgd": "src/ringtrain/compression/powersgd.py",
}


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it is being built
    spec.loader.exec_module(module)
    return module


def _buckets() -> list[list[tuple[int, ...]]]:
    from ringtrain.bench.models import get_preset

    with torch.device("meta"):
        model = get_preset("transformer-25m").build()
    buckets: list[list[tuple[int, ...]]] = [[]]
    size = 0
    for p in reversed(list(model.parameters())):  # backward order, as gradients arrive
        if size + p.numel() * 4 > 64 << 20 and buckets[-1]:
            buckets.append([])
            size = 0
        buckets[-1].append(tuple(p.shape))
        size += p.numel() * 4
    return buckets


def _rank(rank: int, world: int, port: int, steps: int, old_dir: str, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    from ringtrain.compression import powersgd, topk

    old = {k: _load(Path(old_dir) / f"{k}.py", f"old_{k}") for k in FILES}
    reducers = {
        "topk old": old["topk"].TopKReducer(ratio=0.01),
        "topk new": topk.TopKReducer(ratio=0.01),
        "powersgd old": old["powersgd"].PowerSGDReducer(matrix_approximation_rank=2, start_iter=0),
        "powersgd new": powersgd.PowerSGDReducer(matrix_approximation_rank=2, start_iter=0),
    }
    shapes = _buckets()
    gen = torch.Generator().manual_seed(rank)
    flats = [
        torch.randn(sum(int(torch.tensor(s).prod()) for s in b), generator=gen) for b in shapes
    ]
    for red in reducers.values():
        for i, b in enumerate(shapes):
            red.plan(f"bucket{i}", b)
    cpu: dict[str, list[float]] = {k: [] for k in reducers}
    order = list(reducers.items())
    for step in range(steps + 1):  # step 0 is a warm-up
        for name, red in order if step % 2 else order[::-1]:
            dist.barrier()
            t0 = time.process_time()
            for i, flat in enumerate(flats):
                red.reduce(f"bucket{i}", flat, None)
            if step:
                cpu[name].append(time.process_time() - t0)
    out.put((rank, cpu))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", required=True, help="git revision to compare with, e.g. HEAD~1")
    p.add_argument("--np", type=int, default=2, help="ranks (loopback)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per reducer")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as old_dir:
        for name, path in FILES.items():
            text = subprocess.run(
                ["git", "show", f"{args.against}:{path}"],
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            (Path(old_dir) / f"{name}.py").write_text(text)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        procs = [
            ctx.Process(target=_rank, args=(r, args.np, port, args.steps, old_dir, out))
            for r in range(args.np)
        ]
        for proc in procs:
            proc.start()
        try:
            results = sorted(out.get(timeout=900) for _ in procs)
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"| rank | reducer | CPU ms/step, median [min-max] of {args.steps} |")
    print("|---|---|---|")
    for rank, cpu in results:
        for name, xs in cpu.items():
            print(
                f"| {rank} | {name} | {statistics.median(xs) * 1e3:.0f} "
                f"[{min(xs) * 1e3:.0f}-{max(xs) * 1e3:.0f}] |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
