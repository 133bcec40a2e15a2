"""A durable training job for ``ringtrain run --checkpoint-dir/--resume`` tests.

    durable_job.py OUT STEPS PAUSE_S

Trains a small model sharded on every rank (data fixed by step and rank), saving on the job's
schedule; rank 0 writes the final weights to OUT.
"""

from __future__ import annotations

import sys
import time

import torch

import ringtrain as rt
import ringtrain.checkpoint as ckpt


def main() -> None:
    out, total, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        shard_optimizer=True,
    )
    with ckpt.Durable(model=model, optimizer=opt) as job:
        print(f"rank {rt.rank()} starts at step {job.start_step}", flush=True)
        for step in range(job.start_step, total):
            g = torch.Generator().manual_seed(step * 100 + rt.rank())
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
            opt.step()
            job.step(step + 1)
            time.sleep(pause)
    if rt.rank() == 0:
        torch.save([p.detach().clone() for p in model.parameters()], out)
    rt.shutdown()


if __name__ == "__main__":
    main()
