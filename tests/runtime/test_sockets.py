"""Sockets per rank do not grow with the rank count (issue 38 item 4).

A communicator makes 5 Gloo groups (default, control, cpu, engine, lane). Connected eagerly,
each group holds a socket to every other rank: 5 (N - 1) a rank, over 5,000 at 1,024 ranks
(the usual open-file limit is 1,024), and as many store handshakes at start. ringtrain makes
Gloo connect lazily (``TORCH_GLOO_LAZY_INIT``, see runtime/state.py): a pair connects at its
first exchange, and Gloo's ring algorithms talk to two neighbours.
"""

from __future__ import annotations

import pytest

from ringtrain.testing import spawn

GROUPS = 5  # default, control, cpu, engine, lane (runtime/communicator.py)


def _established_after_collectives() -> tuple[int, str | None]:
    import os

    import psutil
    import torch

    import ringtrain as rt

    for i in range(3):
        rt.allreduce(torch.ones(1000), name=f"sum.{i}")
        rt.allgather(torch.ones(10), name=f"gather.{i}")
        rt.broadcast(torch.ones(10), root_rank=i % rt.size(), name=f"bcast.{i}")
        rt.allreduce(torch.ones(4 << 20), name=f"big.{i}")  # 16 MiB: the ring's path
    conns = psutil.Process().net_connections(kind="tcp")
    return sum(c.status == "ESTABLISHED" for c in conns), os.environ.get("TORCH_GLOO_LAZY_INIT")


@pytest.mark.timeout(240)
def test_sockets_per_rank_stay_a_few_at_four_ranks() -> None:
    world = spawn.world(4)
    got = world.run(_established_after_collectives, timeout=180)
    for count, lazy in got:
        assert lazy == "1", got
        # The store, and a ring's two neighbours in the groups that carried ops (eagerly:
        # GROUPS * 3 + 1 = 16 at 4 ranks).
        assert count <= 1 + 2 * 2 + 1, got
