"""A job whose script ends right after an overlapped step() (test_overlap_exit.py), its last
update not waited for: no synchronize(). Rank 1 sleeps ``argv[3]`` s before its last step.
``argv[2]``: ``overlap``, ``plain`` (overlap=False), ``shutdown`` (overlap, then an explicit
``shutdown()``) or ``interrupt`` (overlap; rank 0 then waits to be interrupted). After ringtrain's own exit handler, each rank saves the weights it ends with.

The test gets its reference (``plain``) weights from :func:`train` in an in-process world."""

from __future__ import annotations

import atexit
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ringtrain as rt


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def train(model: torch.nn.Module, mode: str, late: float) -> torch.optim.Optimizer:
    """Four steps; rank 1 sleeps ``late`` s before the last. Ends right after its step(),
    returning the optimizer: the script keeps it alive to its end, as a script's global."""
    rank = rt.rank()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        overlap=mode != "plain",
    )
    rt.broadcast_parameters(model.state_dict(), 0)
    for step in range(4):
        if step == 3 and rank == 1:
            time.sleep(late)
        g = torch.Generator().manual_seed(10 * step + rank)
        opt.zero_grad()
        F.mse_loss(
            model(torch.randn(8, 16, generator=g)), torch.randn(8, 4, generator=g)
        ).backward()
        opt.step()
    return opt


if __name__ == "__main__":
    out, mode, late = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    rank = -1  # rt.rank() is gone once ringtrain has shut down
    model = make_model()

    def _save() -> None:  # registered before init(): runs after ringtrain's exit handler
        torch.save([p.detach().clone() for p in model.parameters()], out / f"weights.{rank}.pt")

    atexit.register(_save)
    rt.init()
    rank = rt.rank()
    opt = train(model, mode, late)  # held to the end: a dropped optimizer ends its updates
    print(f"rank {rank} done", flush=True)
    if mode == "shutdown":
        rt.shutdown()
    if mode == "interrupt" and rank == 0:
        time.sleep(120)
