"""The connection model (ringtrain/host/connections.py) against the sockets 4 ranks really hold.

ringtrain makes Gloo connect lazily (``TORCH_GLOO_LAZY_INIT``, runtime/state.py): a pair of a
group connects at its first exchange. Step by step, a job uses one more kind of traffic of the
model's table and every rank counts its established TCP connections and listening sockets; the
model, given the traffic used so far, must predict both exactly. At 4 ranks a ring (2 peers)
and a full mesh (3) differ, so a pattern or a group the model got wrong shows; the figures at 8
to 1,024 ranks are the same model's (tests/host/test_connections.py). And a Gloo group made
lazily reads nothing from the store at start, at 8 to 1,024 ranks alike (a counting store).
"""

from __future__ import annotations

from typing import Any

import pytest

from ringtrain.testing import spawn


def _socket_table() -> dict[str, tuple[str, int, int] | None]:
    """This process's sockets by inode: (TCP state, local port, remote port), None if not TCP.

    Read from /proc/net until every socket of /proc/self/fd is found: a table read while other
    processes of the host open connections can skip entries (the kernel resumes each chunk at
    an offset), and psutil, which reads it once, then misses connections that are there."""
    import contextlib
    import os

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                mine.add(link[len("socket:[") : -1])
    found: dict[str, tuple[str, int, int] | None] = {}
    for _ in range(50):
        for table in ("tcp", "tcp6", "unix"):
            with open(f"/proc/net/{table}") as f:
                for line in f.read().splitlines()[1:]:
                    x = line.split()
                    inode = x[6] if table == "unix" else x[9]
                    if inode in mine:
                        port = lambda a: int(a.rsplit(":", 1)[1], 16)  # noqa: E731
                        found[inode] = None if table == "unix" else (x[3], port(x[1]), port(x[2]))
        if mine <= found.keys():
            break
    return found


def _steps_measured_and_predicted() -> dict[str, Any]:
    import os

    import torch

    import ringtrain as rt
    import ringtrain.torch as hvd
    from ringtrain.collectives import lane
    from ringtrain.collectives.ops import controller_of
    from ringtrain.environ import Ringtrain
    from ringtrain.host import connections
    from ringtrain.runtime import state

    store_port = int(os.environ[Ringtrain.RENDEZVOUS_PORT])
    established, listening = "01", "0A"  # /proc/net/tcp's states

    def count() -> tuple[int, int, int]:
        """(Gloo's established connections, the store's, listening sockets)."""
        tcp = [s for s in _socket_table().values() if s is not None]
        up = [s for s in tcp if s[0] == established]
        store = sum(remote == store_port for _, _, remote in up)
        return len(up) - store, store, sum(s[0] == listening for s in tcp)

    def check(label: str, uses: list[str], process_sets: Any = ()) -> None:
        kw = {"rank": rt.rank(), "process_sets": process_sets, "config": state.current().config}
        f = connections.footprint(rt.size(), uses, **kw)
        idle = connections.footprint(rt.size(), uses, dozed=False, **kw)
        files = len(os.listdir("/proc/self/fd"))
        predicted = (f.gloo_sockets, (idle.store_sockets, f.store_sockets), f.listeners)
        steps.append((label, count(), predicted, files, f.files))
        # Nobody goes on (connecting to a rank that still counts, or leaving) before all have
        # counted: a new small op travels inline in the negotiation, over the control ring.
        rt.allreduce(torch.ones(1), name=f"counted {label}")

    comm = rt.global_process_set.communicator
    steps: list[Any] = []
    uses = ["negotiation"]  # at start: the topology's all_gather_object on the control group
    check("start", uses)
    # Integers sum alike in any order: Gloo's ring (and, not a float, it leaves the fast lane
    # free for the request the lane step repeats).
    rt.allreduce(torch.ones(2 << 20, dtype=torch.int64), name="big")
    uses.append("ring")
    check("ring", uses)
    rt.grouped_allreduce([torch.ones(16 << 10) for _ in range(4)], name="fused")  # 256 KiB
    uses.append("rank_order")
    check("rank_order", uses)
    # A repeated float request reserves the fast lane at its first (negotiated) run; the next
    # ride it, summing 64 KiB in rank order on the lane group (patient, as in test_lane.py).
    saved, lane.RELEASE_S = lane.RELEASE_S, 60.0
    try:
        for _ in range(8):
            rt.allreduce(torch.ones(16 << 10), name="again")
    finally:
        lane.RELEASE_S = saved
    lane_slots = controller_of(None).lane_slots
    uses.append("lane_rank_order")
    check("lane_rank_order", uses)
    model = torch.nn.Linear(8, 8)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    uses.append("optimizer")
    check("optimizer", uses)
    pair = rt.add_process_set([0, 1])  # members make its groups, the others nothing
    if pair.included():
        rt.allreduce(torch.ones(4 << 20), name="pair", process_set=pair)
    check("process set [0, 1]", uses, [(2, ["negotiation", "ring"])] if pair.included() else ())
    rt.remove_process_set(pair)
    kinds = [k for k in connections.GROUP_KINDS if comm.optional_group(k) is not None]
    return {"steps": steps, "lane_slots": lane_slots, "kinds": kinds}


@pytest.mark.timeout(240)
def test_the_model_predicts_the_sockets_of_four_ranks() -> None:
    from ringtrain.host.connections import GROUP_KINDS
    from ringtrain.host.open_files import BASE_FILES

    world = spawn.world(4)
    got = world.run(_steps_measured_and_predicted, timeout=180)
    for rank, result in enumerate(got):
        assert result["kinds"] == list(GROUP_KINDS), result  # the groups the model counts
        assert result["lane_slots"][0] > 0, result  # a valid slot: the lane's sums ran
        for label, measured, predicted, files, most in result["steps"]:
            gloo, store, listening = measured
            (gloo_model, (store_least, store_most), listeners_model) = predicted
            # Gloo: exactly the model's peers; one listener per Gloo group the model counts, and
            # the rank's door.
            assert (gloo, listening) == (gloo_model, listeners_model), (rank, label, result)
            # The store: the job's connection, and one per set whose controller dozed so far.
            assert store_least <= store <= store_most, (rank, label, result)
            # + the interpreter's own, as the agent's open-file limit counts them
            assert files <= most + BASE_FILES, (rank, label, result)


def _counting_store() -> Any:
    """A torch Store around a HashStore that counts what it is asked (``calls``)."""
    import collections

    import torch.distributed as dist

    class Counting(dist.Store):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.inner = dist.HashStore()
            self.calls: collections.Counter[str] = collections.Counter()

        def set(self, key: str, value: Any) -> None:
            self.calls["set"] += 1
            self.inner.set(key, value)

        def get(self, key: str) -> Any:
            self.calls["get"] += 1
            return self.inner.get(key)

        def multi_get(self, keys: list[str]) -> Any:
            self.calls["multi_get"] += 1
            return self.inner.multi_get(keys)

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self.calls["wait"] += 1
            self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

        def check(self, keys: list[str]) -> bool:
            self.calls["check"] += 1
            return bool(self.inner.check(keys))

        def add(self, key: str, n: int) -> int:
            self.calls["add"] += 1
            return int(self.inner.add(key, n))

        def set_timeout(self, timeout: Any) -> None:
            self.inner.set_timeout(timeout)

    return Counting()


@pytest.mark.parametrize("size", [8, 64, 256, 1024])
def test_a_gloo_group_reads_nothing_from_the_store_at_start(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made lazily (as runtime/state.py sets), a rank's Gloo group only writes its address: no
    read at any size, as the model counts (its peers are read at their first exchange)."""
    import datetime

    import torch.distributed as dist

    from ringtrain.environ import Torch
    from ringtrain.host import connections

    monkeypatch.setenv(Torch.GLOO_LAZY_INIT, "1")
    store = _counting_store()
    group = dist.ProcessGroupGloo(store, size - 1, size, datetime.timedelta(seconds=5))
    del group
    f = connections.footprint(size, [])
    assert dict(store.calls) == {"set": f.store_writes_at_start // f.gloo_groups}
    assert f.store_reads_at_start == 0
