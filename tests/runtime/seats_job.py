"""One rank of a job started by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): init(), one
allreduce of rank + 1, its result on stdout, then (holding the job open) until the file
``SEATS_HOLD`` names exists, shutdown()."""

from __future__ import annotations

import json
import os
import time

import torch

import ringtrain.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), name="sum", op=hvd.Sum)
print(json.dumps({"pid": os.getpid(), "rank": hvd.rank(), "sum": total.item()}), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(os.environ["SEATS_HOLD"]) and time.monotonic() < deadline:
    time.sleep(0.1)
hvd.shutdown()
