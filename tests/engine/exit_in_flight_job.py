"""A job whose script ends right after an outer step, its overlapped exchange still on the wire
(test_local_update_shared_group.py). Rank 0's last exchange sleeps ``argv[2]`` s before it
sends. After ringtrain's own exit handler, each rank writes whether its last exchange had ended."""

from __future__ import annotations

import atexit
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _local import delay_exchanges  # this script's folder is first on sys.path

import ringtrain as rt

out, delay = Path(sys.argv[1]), float(sys.argv[2])
pending: list[Any] = []
rank = -1  # rt.rank() is gone once ringtrain has shut down


def _note() -> None:  # registered before init(): runs after ringtrain's exit handler
    done = all(f.done() and f.exception() is None for f in pending)
    (out / f"ended.{rank}").write_text("yes" if pending and done else "no")


atexit.register(_note)
rt.init()
rank = rt.rank()
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = rt.DistributedOptimizer(
    torch.optim.Adam(model.parameters(), lr=0.01),
    named_parameters=model.named_parameters(),
    sync_every=2,
    outer_compression="int8",
    outer_overlap=True,
)
local = opt.local_update
assert local is not None
for step in range(4):  # the last step is an outer step: its exchange is never merged
    if step == 3 and rt.rank() == 0:  # that exchange alone is late (the first merges at once)
        delay_exchanges(local, delay)
    opt.zero_grad()
    F.mse_loss(model(torch.randn(8, 64)), torch.randn(8, 64)).backward()
    opt.step()
pending += [f.pending for f in local.fragments if f.pending is not None]
print(f"rank {rt.rank()} done", flush=True)
