"""What a durable job's checks cost a training step (checkpoint/step_checks.py), 2 ranks.

Each rank trains a small MLP (256-512-10, batch 256, one torch thread: a step of a few ms, where
a per-step cost shows most) through DistributedOptimizer, in blocks of 100 steps, four variants
interleaved in the same processes, 7 rounds: ``none`` (no ``job.step``), ``durable`` (a
``Durable`` job's ``step()``, its checks spaced as they are), ``every step`` (the same checks
asked every step: ``StepChecks(every_s=0)``) and ``raw gloo`` (``torch.distributed.all_reduce``
of two numbers every step, what any per-step agreement costs). Rank 0 prints each variant's
median wall and CPU (all threads) ms per step, with min-max, and the ratio to ``none``.

    .venv/bin/ringtrain run -np 2 --checkpoint-dir /tmp/ckb --checkpoint-every 1000000 -- \\
        .venv/bin/python scripts/bench_durable_checks.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint.step_checks import StepChecks

STEPS, ROUNDS = 100, 7


def main() -> None:
    torch.set_num_threads(1)
    rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    job = ckpt.Durable(model=model, optimizer=opt)
    every = StepChecks(every_s=0.0)
    x = torch.randn(256, 256)
    extra = {
        "none": lambda step: None,
        "durable": job.step,
        "every step": lambda step: every.at(step, False, False),
        "raw gloo": lambda step: dist.all_reduce(torch.zeros(2)),
    }
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in extra}
    step = 0
    for _ in range(ROUNDS):
        for name, after in extra.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(STEPS):
                step += 1
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                after(step)
            res[name].append(
                ((time.perf_counter() - t0) * 1e3 / STEPS, (time.process_time() - c0) * 1e3 / STEPS)
            )
    every.settle()
    job.close()
    if rt.rank() == 0:
        base = sorted(w for w, _ in res["none"])[ROUNDS // 2]
        for name, runs in res.items():
            wall, cpu = sorted(w for w, _ in runs), sorted(c for _, c in runs)
            mid = ROUNDS // 2
            print(
                f"{name:>10}: wall {wall[mid]:.2f} ms/step ({wall[0]:.2f}-{wall[-1]:.2f}), "
                f"{wall[mid] / base:.2f}x none; CPU {cpu[mid]:.2f} ms/step ({cpu[0]:.2f}-{cpu[-1]:.2f})"
            )
    rt.shutdown()


if __name__ == "__main__":
    main()
