"""A script that torchrun restarts: in the first try (``TORCHELASTIC_RESTART_COUNT=0``) rank 1
raises after a training step while rank 0 waits for it in a negotiated allreduce; rank 1 writes
the time it failed to ``OUT_DIR/failed_at`` and rank 0 the time and words of its own error to
``OUT_DIR/error.0`` (as failing_job.py). The next try trains and writes each rank's attempt and
weights to ``OUT_DIR/result.<rank>``.

    torchrun --max-restarts 1 ... restart_job.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
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
for step in range(1, 4):
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    if attempt == 0:
        if hvd.rank() == 1:
            (out / "failed_at").write_text(repr(time.time()))
            raise ValueError("boom in the first try")
        try:  # rank 0 waits for rank 1 in a negotiated collective, which it never joins
            hvd.allreduce(torch.ones(4), name=f"metric.{step}")
        except Exception as e:
            (out / "error.0").write_text(json.dumps([time.time(), f"{type(e).__name__}: {e}"]))
            raise
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum, name="total")
weights = [round(v, 6) for v in model.weight.flatten().tolist()]
(out / f"result.{hvd.rank()}").write_text(json.dumps([attempt, total.item(), weights]))
hvd.shutdown()
