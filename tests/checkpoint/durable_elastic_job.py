"""An elastic durable job for the preemption test: ``hvd.elastic.run`` around a loop of STEPS
optimizer steps, committed every 5 (rank 0 says so) and saved by ``Durable`` on the job's
schedule; on ``--resume`` the loop starts at the saved step (``job.start_step``). With SIZE, the loop
goes on past STEPS until the world has SIZE ranks (a rank that joins takes a while to start).

    durable_elastic_job.py STEPS [SIZE]
"""

from __future__ import annotations

import os
import sys
import time

import torch

import ringtrain.checkpoint as ckpt
import ringtrain.torch as hvd


def main() -> None:
    total = int(sys.argv[1])
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    job = ckpt.Durable(model=model, optimizer=opt)  # restores model and optimizer on --resume
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=job.start_step)
    print(f"rank {hvd.rank()} starts at step {job.start_step}, pid {os.getpid()}", flush=True)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.step < total or hvd.size() < size:
            g = torch.Generator().manual_seed(state.step)
            opt.zero_grad()
            model(torch.randn(8, 4, generator=g)).sum().backward()
            opt.step()
            state.step += 1
            job.step(state.step)
            if state.step % 5 == 0:
                state.commit()
                if hvd.rank() == 0:
                    print(f"rank 0 of {hvd.size()} commits step {state.step}", flush=True)
            time.sleep(0.1)

    with job:
        train(state)
    print(f"rank {hvd.rank()} of {hvd.size()} ends at step {state.step}", flush=True)


if __name__ == "__main__":
    main()
