"""What the GPU tests share: this rank's GPU as a Horovod script picks it, a small classifier on
it, and the per-rank batches its training steps take."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import ringtrain as rt
import ringtrain.torch as hvd


def rank_gpu() -> torch.device:
    """This rank's GPU, as a Horovod script picks it after ``hvd.init()``."""
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def classifier(seed: int) -> torch.nn.Module:
    """16 -> 64 -> 5, from ``seed``, on this rank's GPU."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
    return net.to(rank_gpu())


def train(model: torch.nn.Module, opt: Any, steps: range) -> None:
    """``opt`` steps on this rank's own batch of 8 for each step (seeded by step and rank)."""
    dev = next(model.parameters()).device
    for step in steps:
        g = torch.Generator().manual_seed(100 * step + rt.rank())
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        opt.step()
