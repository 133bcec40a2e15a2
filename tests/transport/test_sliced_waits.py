"""The transport's waits outside the collectives' own (``group_ops.all_gather_object``,
``barrier``, ``wait``: the straggler report's gather and link probe, the sharded state's
gathers): they gather as torch's blocking calls do, and in an elastic job a call that a lost
peer never joins ends once the launcher announces a newer world, not at the transport timeout.

Two ranks in one process: a Gloo group each over one store, on threads. A "lost" rank 1 makes
its group but completes what rank 0 left under way only after rank 0 gave up, so both groups
are destroyed cleanly.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from ringtrain.errors import CollectiveAbortedError
from ringtrain.runtime import abort
from ringtrain.transport import group_ops


@pytest.fixture
def groups() -> Iterator[list[dist.ProcessGroup]]:
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=60)
    made: dict[int, dist.ProcessGroup] = {}
    threads = [
        threading.Thread(
            target=lambda r=r: made.update({r: dist.ProcessGroupGloo(store, r, 2, timeout)})
        )
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    yield [made[0], made[1]]


def both(call: Callable[[int], object]) -> dict[int, object]:
    got: dict[int, object] = {}
    threads = [threading.Thread(target=lambda r=r: got.update({r: call(r)})) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return got


def test_the_object_gather_gives_every_ranks_object_in_rank_order(
    groups: list[dist.ProcessGroup],
) -> None:
    objects = [("rank0", 1.5), {"rank": 1, "pad": "x" * 500}]

    def gather(r: int) -> list[object]:
        outs: list[object] = [None, None]
        group_ops.all_gather_object(outs, objects[r], groups[r])
        return outs

    assert both(gather) == {0: objects, 1: objects}


@pytest.mark.parametrize("call", ["all_gather_object", "barrier"])
def test_a_call_a_lost_peer_never_joins_ends_when_a_newer_world_is_announced(
    groups: list[dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    def run(r: int) -> None:
        if call == "barrier":
            group_ops.barrier(groups[r])
        else:
            group_ops.all_gather_object([None, None], r, groups[r])

    announced_at = time.monotonic() + 0.3
    monkeypatch.setattr(abort, "generation", 0)
    monkeypatch.setattr(abort, "announced", lambda: int(time.monotonic() >= announced_at))
    start = time.monotonic()
    with pytest.raises(CollectiveAbortedError, match="announced a new world"):
        run(0)
    assert time.monotonic() - start < 10  # one slice (1 s) past the announcement; Gloo: 60 s
    # The late peer completes what rank 0 left under way: the barrier, or the gather's first
    # step (the pickles' lengths).
    if call == "barrier":
        groups[1].barrier().wait()
    else:
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        groups[1].allgather([lengths], [torch.tensor([1], dtype=torch.int64)]).wait()
