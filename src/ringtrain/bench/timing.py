"""One timed sample of a collective: every rank starts together, from a quiet process.

Quiet means this rank's ringtrain controllers are dozing. After a ringtrain collective they keep
negotiating idle rounds for a few tens of milliseconds (each a Gloo allgather, about a
millisecond of CPU), and a torch case timed inside that window pays for them: on one core per
rank that made a 64 MiB torch allreduce 30-40% slower and flattered every ringtrain/torch ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch.distributed as dist

from ringtrain.collectives import lane
from ringtrain.runtime import state

SETTLE_TIMEOUT_S = 1.0
# Ops of each case run before its first sample. A repeated op rides the fast lane once the lane
# has given up the last name's reservation (SWITCH_AFTER ops negotiated), lost that slot and
# reopened for it, in the controller's rounds (two ops more were not always enough): timed
# earlier, a large size's first samples were negotiated ops and a lost slot (4 of 11 ops at
# 4 MiB in `bench allreduce`), which no training loop pays. `bench allreduce` reports the rest.
WARM_UP_OPS = lane.SWITCH_AFTER + 4


def settle() -> None:
    """Wait (at most a second) until every controller of this rank dozes."""
    if not state.is_initialized():
        return
    for ps in state.current().process_sets.values():
        ctl = ps.communicator.service("controller")
        if ctl is not None:
            ctl.settle(SETTLE_TIMEOUT_S)


def seconds_per_op(op: Callable[[], object], iters: int) -> float:
    """Run ``op`` ``iters`` times back to back after a quiet start and a barrier."""
    settle()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    return (time.perf_counter() - t0) / iters
