"""A flipped byte, a replayed message and a reordered one each stop the job on every rank.

Rank 0 tampers with one of its own outgoing messages (the sealing layer's testing-only fault
injection stands in for an attacker on the wire). Every rank must raise SecurityError naming
rank 0 as the peer whose message was rejected, within seconds, and no rank may hang.
"""

from __future__ import annotations

import time

import pytest
import torch

import ringtrain as rt
from ringtrain.errors import SecurityError
from ringtrain.testing import spawn


def _tamper(kind: str, after: int) -> str:
    from ringtrain.security import sealing

    if rt.rank() == 0:
        sealing.inject_fault(kind, sender=0, after=after)
    try:
        for i in range(300):
            rt.allreduce(torch.full((64,), float(i)), name=f"tamper.{i}")
        return "no error"
    except SecurityError as e:
        return f"SecurityError: {e}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        sealing.clear_faults()


WHY = {"flip": "modified in transit", "replay": "is a replay", "reorder": "out of order"}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("kind", ["flip", "replay", "reorder"])
def test_tampering_stops_every_rank(kind: str, size: int, key_file: str) -> None:
    world = spawn.world(size)
    world.run(_ready, init=False)  # the processes are up before the clock starts
    started = time.monotonic()
    got = world.run(_tamper, kind, 25, timeout=60, secure=True, key_file=key_file, timeout_s=30)
    elapsed = time.monotonic() - started
    for rank, msg in enumerate(got):
        assert msg.startswith("SecurityError"), f"rank {rank}: {msg}"
        assert "from rank 0 " in msg and WHY[kind] in msg, f"rank {rank}: {msg}"
    assert elapsed < 20, f"ranks took {elapsed:.1f} s to fail"
    # the ranks are fine afterwards: a new job on the same processes works
    assert world.run(_sum, secure=True, key_file=key_file) == [float(size)] * size


def _ready() -> bool:
    return True


def _sum() -> float:
    return float(rt.allreduce(torch.ones(1), op=rt.Sum).item())


def _no_faults_by_env() -> bool:
    from ringtrain.security import sealing

    return sealing._faults.active


def test_fault_injection_is_off_by_default(world2: spawn.World, key_file: str) -> None:
    assert world2.run(_no_faults_by_env, secure=True, key_file=key_file) == [False, False]
