"""A job whose last rank is killed (SIGKILL: no last words, as the OOM killer or a lost process)
while every other rank waits for it in a negotiated allreduce.

    python vanish_job.py OUT_DIR

The last rank writes the time it was killed to ``OUT_DIR/killed_at``; every other rank writes
``[host, the error its wait ended with, time.time()]`` to ``OUT_DIR/error.<rank>`` before it exits.
"""

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

import ringtrain.torch as hvd

torch.set_num_threads(1)
out = Path(sys.argv[1])
hvd.init()
last = hvd.size() - 1
try:
    for step in range(1, 1000):
        if hvd.rank() == last and step == 6:
            (out / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        hvd.allreduce(torch.ones(4), name=f"metric.{step}")
except Exception as e:
    said = [socket.gethostname(), f"{type(e).__name__}: {e}", time.time()]
    (out / f"error.{hvd.rank()}").write_text(json.dumps(said))
    raise
