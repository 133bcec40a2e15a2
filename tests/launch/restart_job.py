"""A script that torchrun restarts: rank 1 raises after a training step in the first try
(``TORCHELASTIC_RESTART_COUNT=0``); the next try trains and writes each rank's attempt and
weights to ``OUT_DIR/result.<rank>``.

    torchrun --max-restarts 1 ... restart_job.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import ringtrain.torch as hvd

out = Path(sys.argv[1])
hvd.init()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
x = torch.full((2, 4), float(hvd.rank() + 1))
for _ in range(3):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if attempt == 0 and hvd.rank() == 1:
        raise ValueError("boom in the first try")
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
weights = [round(v, 6) for v in model.weight.flatten().tolist()]
(out / f"result.{hvd.rank()}").write_text(json.dumps([attempt, total.item(), weights]))
hvd.shutdown()
