"""Per-step cost of training with ``DistributedOptimizer`` against plain Adam, interleaved.

Run under a launcher with 2 ranks (one thread each); every rank builds ``bench converge``'s tiny
LM (or ``$TASK``'s model) once per variant and times blocks of 40 steps in turn (variant A, B, C, A, B, C, ...):

* ``plain``: the model with torch's Adam, no exchange (what one host does);
* ``local``: ``DistributedOptimizer(sync_every=10**6)``, so every step is an inner step of local
  updates (no outer step in the measured steps);
* ``ringtrain``: synchronous ``DistributedOptimizer`` (the gradients averaged every step).

``TASK=mlp`` (or ``digits``) builds that task's model instead of the LM. Rank 0 prints the
median ms per step and the spread over 6 blocks. For example::

    ringtrain run -np 2 -x OMP_NUM_THREADS=1 -- python scripts/bench_inner_step.py plain,local
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch

import ringtrain
from ringtrain.bench import converge, converge_tasks

BLOCK, BLOCKS = 40, 6


def main() -> int:
    kinds = (sys.argv[1] if len(sys.argv) > 1 else "plain,local").split(",")
    ringtrain.init()
    torch.set_num_threads(1)
    task = converge_tasks.build(
        os.environ.get("TASK", "lm"), None, 0, converge.ConvergeParams().width
    )
    g = torch.Generator().manual_seed(1)

    def build(kind: str) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(0)
        model = task.build()
        base = torch.optim.Adam(model.parameters(), lr=1e-3)
        if kind == "plain":
            return model, base
        extra: dict[str, Any] = {"sync_every": 10**6} if kind == "local" else {}
        named = model.named_parameters()
        return model, ringtrain.DistributedOptimizer(base, named_parameters=named, **extra)

    def block(model: torch.nn.Module, opt: Any, n: int = BLOCK) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            idx = torch.randint(0, task.train_x.shape[0], (32,), generator=g)
            opt.zero_grad(set_to_none=True)
            task.loss(model(task.train_x[idx]), task.train_y[idx]).backward()
            opt.step()
        return (time.perf_counter() - t0) / n * 1e3

    runs = {k: build(k) for k in kinds}
    for k in kinds:
        block(*runs[k], n=10)  # warm-up
    ms: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(BLOCKS):
        for k in kinds:
            ms[k].append(block(*runs[k]))
    if ringtrain.rank() == 0:
        for k in kinds:
            v = ms[k]
            print(f"{k:10s} {statistics.median(v):7.1f} ms/step  ({min(v):.1f}-{max(v):.1f})")
    ringtrain.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
