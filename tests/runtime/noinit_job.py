"""A job whose rank 1 never calls ``init()``: ``NOINIT=exit0`` ends with code 0 before it,
``NOINIT=sleep`` sleeps instead. The other ranks call ``init()`` and one allreduce."""

from __future__ import annotations

import os
import time

import torch

import ringtrain.torch as hvd

if os.environ["RINGTRAIN_RANK"] == "1":
    print("rank 1 skips init", flush=True)
    if os.environ["NOINIT"] == "exit0":
        raise SystemExit(0)
    time.sleep(3600)
hvd.init()
hvd.allreduce(torch.ones(2), name="a")
print("done", flush=True)
