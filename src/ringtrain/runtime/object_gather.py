"""Every rank's picklable object, gathered as ``dist.all_gather_object`` does (a gather of the
pickles' lengths, then of the pickles padded to the longest), with each wait left to the caller:
so a wait can be sliced (:mod:`.abort`, :mod:`.forming_gather`), which torch's blocking call
cannot. For groups on host memory (Gloo, ringtrain's sealed and tcp groups)."""

from __future__ import annotations

import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist

from ringtrain.runtime.contracts import Group, Work


def all_gather_object(
    obj: object, size: int, group: Group, wait: Callable[[Work], None]
) -> list[object]:
    """Every rank's ``obj`` in rank order, over ``group`` of ``size`` ranks; ``wait`` waits for
    each of the two gathers."""
    mine = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    length = torch.tensor([mine.numel()], dtype=torch.int64)
    wait(_issued(dist.all_gather(lengths, length, group=group, async_op=True)))
    longest = max(int(n) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    every = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    wait(_issued(dist.all_gather(every, padded, group=group, async_op=True)))
    # The peers' pickles, as torch's all_gather_object unpickles them: ranks of one job.
    return [pickle.loads(t[: int(n)].numpy().tobytes()) for t, n in zip(every, lengths)]


def _issued(work: dist.Work | None) -> Work:
    assert work is not None  # issued with async_op=True by a member of the group
    return work
