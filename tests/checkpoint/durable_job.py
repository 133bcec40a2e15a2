"""A durable training job for ``ringtrain run --checkpoint-dir/--resume`` tests.

    durable_job.py OUT STEPS PAUSE_S [sharded|local]

Trains a small model (data fixed by step and rank), saving on the job's schedule: ``sharded``
(the default) with the optimizer state sharded, rank 0 writing the final weights to OUT;
``local`` with local updates (``sync_every=4``, a 4-bit outer exchange), whose ranks' weights
differ mid-round, so each rank writes its own to OUT.<rank>.
"""

from __future__ import annotations

import sys
import time

import torch

import ringtrain as rt
import ringtrain.checkpoint as ckpt


def main() -> None:
    out, total, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    local = sys.argv[4:] == ["local"]
    # outer_overlap given: two separate runs compare bit for bit, so neither measures its link
    # to choose it (a bare sync_every's defaults, engine/local_defaults).
    in_line = {"sync_every": 4, "outer_compression": "int4", "outer_overlap": False}
    step_kind = in_line if local else {"shard_optimizer": True}
    rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        **step_kind,
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
    if local or rt.rank() == 0:
        weights = [p.detach().clone() for p in model.parameters()]
        torch.save(weights, f"{out}.{rt.rank()}" if local else out)
    rt.shutdown()


if __name__ == "__main__":
    main()
