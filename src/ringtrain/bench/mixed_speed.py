"""Mixed-speed benchmark: equal shares vs ``batch_shares="auto"`` with one rank slowed.

Run under the launcher, one rank per core (2 ranks on a 2-core machine)::

    ringtrain run -np 2 python -m ringtrain.bench.mixed_speed --slow-rank 1

Every rank pins itself to core ``rank % cores`` and runs torch on one thread; the slow rank
starts a CPU hog (a busy process) pinned to its own core, so it runs at about half speed. Each
rank first times its own compute alone (no communication), then the job trains an MLP for the
same number of global batches with equal shares and with ``"auto"`` (after auto has settled),
and rank 0 prints the samples/s of each and their ratios, side by side in one run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.elastic.share_sampler import split_counts
from ringtrain.engine.auto_shares import MEASURE_STEPS, WARMUP_STEPS


def _hog(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _alone(batch: int, steps: int) -> float:
    """This rank's samples/s on its own (forward, backward, SGD step)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return batch * steps / (time.perf_counter() - start)


def _train(shares: str | None, global_batch: int, steps: int) -> tuple[float, tuple[float, ...]]:
    """Samples/s of the job over ``steps`` global batches (after auto settles), and the shares."""
    model = _model()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        batch_shares=shares,
    )
    x, y = torch.randn(global_batch, 256), torch.randint(0, 10, (global_batch,))
    settle = 1 + WARMUP_STEPS + MEASURE_STEPS + 2 if shares == "auto" else 3
    start = 0.0
    for step in range(settle + steps):
        if step == settle:
            rt.allreduce(torch.zeros(1), name="bench.mark")
            start = time.perf_counter()
        now = opt.batch_shares or (1.0,) * rt.size()
        mine = split_counts(global_batch, now)[rt.rank()]
        if shares == "auto":  # weigh by the samples each rank takes of this batch
            opt.set_batch_shares(split_counts(global_batch, now))
        opt.zero_grad()
        F.cross_entropy(model(x[:mine]), y[:mine]).backward()
        opt.step()
    rt.allreduce(torch.zeros(1), name="bench.end")
    return global_batch * steps / (time.perf_counter() - start), tuple(now)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    rt.init()
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rt.rank() % len(cores)]
    os.sched_setaffinity(0, {core})
    hog = None
    if rt.rank() == args.slow_rank:
        hog = multiprocessing.get_context("fork").Process(target=_hog, args=(core,), daemon=True)
        hog.start()
    try:
        alone = rt.allgather_object(_alone(args.global_batch // rt.size(), 20))
        equal, _ = _train(None, args.global_batch, args.steps)
        auto, shares = _train("auto", args.global_batch, args.steps)
    finally:
        if hog is not None:
            hog.terminate()
            hog.join()
    if rt.rank() == 0:
        print(
            f"mixed speed, {rt.size()} ranks, rank {args.slow_rank} beside a CPU hog on its core: "
            f"alone {', '.join(f'{a:.0f}' for a in alone)} samples/s (sum {sum(alone):.0f}); "
            f"equal shares {equal:.0f}, auto {auto:.0f} samples/s (shares {list(shares)}); "
            f"auto/equal {auto / equal:.2f}x, auto/sum-of-alone {auto / sum(alone):.2f}x"
        )
    rt.shutdown()


if __name__ == "__main__":
    main()
