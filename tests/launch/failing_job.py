"""A training script whose rank 1 fails after ``init()`` while rank 0 waits for it somewhere.

    python failing_job.py OUT_DIR HOW WHERE

HOW: ``raise`` (an uncaught ValueError), ``finally`` (the same ValueError with
``hvd.shutdown()`` in a ``finally:`` block, as scripts clean up), ``exit3`` (``sys.exit(3)``),
``checkpoint`` (a CheckpointError, as a failed load raises it), ``osexit`` (``os._exit(5)``:
no last words, but an exit code), ``kill`` (SIGKILL: no last
words, as the OOM killer or a lost host). WHERE rank 0 waits when rank 1
fails: ``allreduce`` (a negotiated collective), ``lane`` (an allreduce repeated until the fast
lane carries it), ``step`` (``DistributedOptimizer.step()``), ``first-step`` (the same at
the first step, whose plan the ranks agree on: rank 1 fails at step 1), ``save``
(``ringtrain.checkpoint.save``). Rank 1
writes the time it failed to ``OUT_DIR/failed_at``, and each rank the last words it got from
ringtrain, with the time, to ``OUT_DIR/error.0`` (and whether it is a ``HorovodInternalError``
to ``OUT_DIR/horovod.0``) before it exits (with ``exit3``, ``osexit``, ``kill``, ``finally`` and
``first-step``,
rank 0 ignores the launcher's SIGTERM so that it always does).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import ringtrain.torch as hvd
from ringtrain.errors import CheckpointError
from ringtrain.runtime.state import global_process_set

out, how, where = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
if where == "save":  # only there: it imports torch.distributed.tensor, costly in CPU
    import ringtrain.checkpoint
FAIL_AT = 1 if where == "first-step" else 6

hvd.init()
if (how in ("exit3", "osexit", "kill", "finally") or where == "first-step") and hvd.rank() == 0:
    # The launcher stops the peers as soon as rank 1 has exited; this one takes the time to
    # say what it heard (the test reads its error), as a script that handles SIGTERM would.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if where == "first-step":
    # Rank 1 fails right after init(), which it may leave before rank 0 does: this barrier
    # holds it until rank 0 ignores SIGTERM (else the launcher's could end rank 0 first).
    hvd.barrier()
model = torch.nn.Linear(8, 2)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)


def fail() -> None:
    (out / "failed_at").write_text(repr(time.time()))
    if how == "exit3":
        sys.exit(3)
    if how == "osexit":
        os._exit(5)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "checkpoint":
        raise CheckpointError(f"checkpoint {out / 'missing'} has no manifest (a test's failure)")
    if how == "finally":
        try:
            raise ValueError(f"boom at step {FAIL_AT}")
        finally:
            hvd.shutdown()
    raise ValueError(f"boom at step {FAIL_AT}")


try:
    for step in range(1, 1000):
        if hvd.rank() == 1 and step == FAIL_AT:
            fail()
        if where == "allreduce":
            hvd.allreduce(torch.ones(4), name=f"metric.{step}")
        elif where == "lane":
            hvd.allreduce(torch.ones(4096), name="metric")  # above inline size: lane-eligible
            if step == FAIL_AT - 1:  # the test checks the lane carried the repeats by then
                ctl = global_process_set.communicator.service("controller")
                (out / f"lane.{hvd.rank()}").write_text(repr(ctl.lane_slots))
        elif where == "save" and step >= FAIL_AT:
            ringtrain.checkpoint.save(out / f"step-{step}", model=model, optimizer=opt, step=step)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
except Exception as e:
    if hvd.rank() == 0:  # when and what: the torchrun test times the peer's own end
        (out / "error.0").write_text(json.dumps([time.time(), f"{type(e).__name__}: {e}"]))
        (out / "horovod.0").write_text(repr(isinstance(e, hvd.HorovodInternalError)))
    raise
