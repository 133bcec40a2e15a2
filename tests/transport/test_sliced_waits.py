"""The transport's blocking calls (``group_ops.all_gather_object``, ``barrier``, ``wait``:
the straggler report's gathers, the sharded state's gathers; the data collectives the
controller thread runs for ``hvd.*`` calls, through ``finish``): they work as torch's blocking
calls do, and in an elastic job a call that a lost peer never joins ends once the launcher
announces a newer world, not at the transport timeout. Point-to-point waits (the link probe's)
cannot be sliced on Gloo: the last two tests show why and that the probe waits plainly.

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

from ringtrain.collectives import ordered, step_timing
from ringtrain.errors import CollectiveAbortedError
from ringtrain.runtime import abort
from ringtrain.transport import group_ops


@pytest.fixture
def groups() -> Iterator[list[dist.ProcessGroup]]:
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=60)
    made: dict[int, dist.ProcessGroup] = {}
    threads = [
        threading.Thread(target=lambda r=r: made.update({r: _group(store, r, timeout)}))
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    yield [made[0], made[1]]


def _group(store: dist.Store, rank: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """A Gloo group of 2 as torch's ``new_group`` makes one (a ``ProcessGroup`` over a Gloo
    backend, which the runtime's groups are), not registered with torch's default world."""
    group = dist.ProcessGroup(store, rank, 2)
    gloo = dist.ProcessGroupGloo(store, rank, 2, timeout)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return group


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


# The collectives' blocking data calls (the controller thread runs them for hvd.* ops): each
# as rank ``r`` calls it on its group. The late peer calls the same to complete the op. Not
# here: Gloo's reduce-scatter, whose work ignores a timed wait (hvd.reducescatter on Gloo takes
# ringtrain's ring, whose point-to-point waits cannot be sliced either).
DATA_CALLS: dict[str, Callable[[dist.ProcessGroup], object]] = {
    "allreduce": lambda g: group_ops.allreduce(torch.ones(8), g),
    "broadcast": lambda g: group_ops.broadcast(torch.ones(8), g, 0),
    "all_gather_into": lambda g: group_ops.all_gather_into(torch.empty(16), torch.ones(8), g),
    "all_gather": lambda g: group_ops.all_gather(
        [torch.empty(8), torch.empty(8)], torch.ones(8), g
    ),
    # hvd.allreduce of floats from 3 ranks (two all-to-alls, summed in rank order between)
    "ordered_allreduce": lambda g: ordered.allreduce(torch.ones(8), "Sum", g, ordered.Scratch()),
    "all_to_all": lambda g: _all_to_all(g),
}


def _all_to_all(g: dist.ProcessGroup) -> None:
    """An unfused hvd.alltoall's call: the work waited through ``finish`` on its output."""
    out = torch.empty(8)
    group_ops.finish(group_ops.all_to_all(out, torch.ones(8), None, None, g), out)


@pytest.mark.parametrize("call", sorted(DATA_CALLS))
def test_a_data_collective_a_lost_peer_never_joins_ends_when_a_newer_world_is_announced(
    groups: list[dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Before, the controller thread of the abandoned world sat in these until the transport
    timeout (docs/elastic.md listed it as not done); its caller left on its own sliced wait."""
    announced_at = time.monotonic() + 0.3
    monkeypatch.setattr(abort, "generation", 0)
    monkeypatch.setattr(abort, "announced", lambda: int(time.monotonic() >= announced_at))
    start = time.monotonic()
    with pytest.raises(CollectiveAbortedError, match="announced a new world"):
        DATA_CALLS[call](groups[0])
    assert time.monotonic() - start < 10  # one slice (1 s) past the announcement; Gloo: 60 s
    monkeypatch.setattr(abort, "announced", None)  # the late peer: a plain blocking call
    if call == "ordered_allreduce":  # rank 0 left before its second all-to-all: only the first
        rows = torch.empty(32, dtype=torch.uint8)
        flat = torch.ones(8).view(torch.uint8)
        group_ops.all_to_all(rows, flat, [16, 16], [16, 16], groups[1]).wait()
    else:
        DATA_CALLS[call](groups[1])  # completes what rank 0 left under way


def test_an_old_worlds_controller_thread_leaves_a_wait_it_starts_after_the_process_moved_on(
    groups: list[dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process already runs in world 1 (announced and entered) when the controller thread
    of world 0 starts one more collective. Its wait counts from the thread's own world
    (``abort.bind_world``, as ``Controller._run`` does), so it ends at the first slice; counted
    from the process's world it would sit in Gloo until the transport timeout."""
    monkeypatch.setattr(abort, "generation", 1)
    monkeypatch.setattr(abort, "announced", lambda: 1)
    got: list[BaseException] = []

    def old_controller() -> None:
        abort.bind_world(0)
        try:
            group_ops.allreduce(torch.ones(8), groups[0])
        except CollectiveAbortedError as e:
            got.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=old_controller)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and len(got) == 1, got
    assert time.monotonic() - start < 10  # one slice (1 s); Gloo: 60 s
    monkeypatch.setattr(abort, "announced", None)  # the late peer completes what was left
    group_ops.allreduce(torch.ones(8), groups[1])


def test_outside_elastic_jobs_the_data_collectives_are_torchs_blocking_calls(
    groups: list[dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No elastic job: no wait of ringtrain's in between (abort.wait_work is never called)."""
    monkeypatch.setattr(abort, "announced", None)

    def unexpected(*args: object, **kwargs: object) -> None:
        raise AssertionError("a sliced wait outside an elastic job")

    monkeypatch.setattr(abort, "wait_work", unexpected)
    out = both(lambda r: [DATA_CALLS[c](groups[r]) for c in sorted(DATA_CALLS)])
    assert sorted(out) == [0, 1]


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


def test_a_gloo_receive_cannot_be_waited_in_slices(groups: list[dist.ProcessGroup]) -> None:
    """Why the link probe's send and receive wait plainly (collectives/step_timing.py): a Gloo
    receive whose timed wait runs out closes the pair's connection, so the peer's send that
    follows fails; and a receive never reports completion before ``wait()``, so it cannot be
    polled either. A collective's work (the tests above) can be waited on again."""
    got = torch.zeros(4)
    polled = groups[0].recv([got], 1, 0)
    groups[1].send([torch.ones(4)], 0, 0).wait()
    arrival = time.monotonic() + 10
    while got.sum() != 4 and time.monotonic() < arrival:
        time.sleep(0.05)
    assert got.sum() == 4 and not polled.is_completed()  # arrived, not reported
    polled.wait()
    received = groups[0].recv([got], 1, 1)
    with pytest.raises(RuntimeError, match="Timed out"):
        received.wait(datetime.timedelta(seconds=0.2))
    # The send the posted receive would have taken never completes: it fails at once, or, when
    # the closing reaches rank 1 late (seen beside stress-ng), at the end of its wait.
    with pytest.raises(RuntimeError, match=r"Connection closed by peer|Timed out waiting"):
        groups[1].send([torch.ones(4)], 0, 1).wait(datetime.timedelta(seconds=10))


def test_a_link_probe_slower_than_a_slice_measures_in_an_elastic_job(
    groups: list[dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The straggler report's link probe on a link slower than a wait slice: rank 1's transfer
    starts 1.5 s late. Sliced, rank 0's receive ran out after 1 s and closed the connection
    (the probe failed); waited plainly, both ranks measure both hosts."""
    monkeypatch.setattr(abort, "generation", 0)
    monkeypatch.setattr(abort, "announced", lambda: 0)  # elastic, no newer world

    def late_send(t: torch.Tensor, dst: int, group: dist.ProcessGroup, tag: int) -> dist.Work:
        if group is groups[1] and tag == step_timing._PAYLOAD:
            time.sleep(1.5)
        return group.send([t], dst, tag)

    # The groups are made directly, not registered with torch (whose calls by world rank would
    # look them up): the probe's point-to-point and rank questions go to them as they are.
    monkeypatch.setattr(group_ops, "send", late_send)
    monkeypatch.setattr(group_ops, "recv", lambda t, src, group, tag: group.recv([t], src, tag))
    monkeypatch.setattr(group_ops, "rank", lambda group: group.rank())
    monkeypatch.setattr(group_ops, "size", lambda group: group.size())
    got = both(lambda r: step_timing.probe_links(groups[r], ["h0", "h1"], nbytes=1024))
    assert sorted(got) == [0, 1]
    assert all(sorted(links) == ["h0", "h1"] and min(links.values()) > 0 for links in got.values())
