"""A 2-rank job whose rank 1 leaves (os._exit(0)) while rank 0's saves are in flight.

Rank 0 saves step 2 into ``a`` (process writer, closed by ``with``), ``b`` (thread writer,
left open: closed at exit) and ``c`` (thread writer), whose part of rank 1 is written before
it leaves. Rank 0 catches the collective's HorovodInternalError and ends normally, and writes
when its at-exit work ended to ``done_at``. argv: OUT.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
# Registered before ringtrain's at-exit work (which closes ``b``), so run after it (last in,
# first out): when rank 0 is done giving up, before the interpreter and the launcher wind down.
atexit.register(lambda: rank == 0 and (out / "done_at").write_text(repr(time.time())))

import torch  # noqa: E402

import ringtrain.checkpoint as ckpt  # noqa: E402
import ringtrain.torch as hvd  # noqa: E402

rank = -1
hvd.init()
rank = hvd.rank()
model = torch.nn.Linear(64, 64)
a = ckpt.Checkpointer(out / "a", writer="process")
b = ckpt.Checkpointer(out / "b", writer="thread")
c = ckpt.Checkpointer(out / "c", writer="thread")
for saver in (a, b, c):
    saver.save(1, model=model)  # the first save of each agrees on its id: every rank
    saver.wait()
(out / f"pids-{rank}").write_text(" ".join(str(p) for p in (os.getpid(), a.writer_pid)))
hvd.allreduce(torch.ones(1), name="ready")
c.save(2, model=model)
if rank == 1:
    c.wait()  # its part of c's step 2 is written: that save commits
    (out / "left_at").write_text(repr(time.time()))
    os._exit(0)  # and it never saves a's and b's step 2
with a:
    a.save(2, model=model)
    b.save(2, model=model)
    try:
        hvd.allreduce(torch.ones(1), name="after")
    except hvd.HorovodInternalError as e:
        print("rank 0 caught:", type(e).__name__, flush=True)
c.close()
