"""What one checkpoint load costs each rank: wall time, CPU time, and peak memory above the
process's size before the load (the bytes the load itself holds at its peak).

    # once: a checkpoint of about MB megabytes (weights and Adam's two states)
    ringtrain run -np 2 -- python scripts/bench_checkpoint_load.py DIR --mb 256 --save
    # then each measurement in fresh processes (peak memory only grows within a process)
    ringtrain run -np 2 -- python scripts/bench_checkpoint_load.py DIR --mb 256

Rank 0 prints one line per rank. The page cache is left warm: this measures what the ranks
spend, not the disk.
"""

from __future__ import annotations

import argparse
import resource
import time

import psutil
import torch

import ringtrain
import ringtrain.checkpoint as ckpt


def _model(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 1024  # 4 MiB per weight; Adam's state triples the checkpoint
    layers = max(1, mb // 12)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--save", action="store_true")
    args = ap.parse_args()
    ringtrain.init()
    model, opt = _model(args.mb)
    if args.save:
        ckpt.save(args.dir, model=model, optimizer=opt, step=1)
        ringtrain.shutdown()
        return
    ringtrain.barrier()
    rss = psutil.Process().memory_info().rss
    cpu, wall = time.process_time(), time.perf_counter()
    ckpt.load(args.dir, model=model, optimizer=opt)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    rows = ringtrain.allgather_object((ringtrain.rank(), wall, cpu, max(0, peak - rss)))
    if ringtrain.rank() == 0:
        for r, w, c, extra in rows:
            print(f"rank {r}: load {w:.2f} s wall, {c:.2f} s CPU, peak +{extra / 2**20:.0f} MiB")
    ringtrain.shutdown()


if __name__ == "__main__":
    main()
