"""Step timings and the link probe on real ranks (loopback; hosts faked by name)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import ringtrain as rt
from ringtrain.collectives import step_timing
from ringtrain.diagnostics.straggler import SLOW_LINK_FACTOR
from ringtrain.runtime.state import global_process_set
from ringtrain.testing.spawn import World
from ringtrain.transport import group_ops


def _probe() -> dict[str, float]:
    group = global_process_set.communicator.group("engine")
    hosts = ["a", "b", "b"][: rt.size()]
    return step_timing.probe_links(group, hosts, nbytes=64 * 1024)


def test_probe_measures_every_host(world3: World) -> None:
    rates = world3.run(_probe, timeout=60)
    assert rates[0] == rates[1] == rates[2]
    assert set(rates[0]) == {"a", "b"} and all(r > 0 for r in rates[0].values())


def _probe_with_a_slow_host_and_a_late_leader() -> dict[str, float]:
    """Hosts a, b, c (ranks 0-2); c's link is slow: every probe payload to or from it arrives
    0.5 s late. Rank 0 leaves every barrier 1 s after the others (descheduled, or held by a
    slow link)."""
    barrier, send = group_ops.barrier, group_ops.send
    slow = {(1, 2), (2, 0)}  # (from, to): the ring's two transfers over c's link
    me = rt.rank()

    def late(group: Any) -> None:
        barrier(group)
        time.sleep(1.0)

    def slow_send(t: torch.Tensor, dst: int, group: Any, tag: int = 0) -> Any:
        def go() -> Any:
            return send(t, dst, group, tag)

        if t.numel() != LATE_PROBE_BYTES or (me, dst) not in slow:
            return go()
        return _Late(go)  # under way at once, as a send is; it arrives 0.5 s later

    group_ops.send = slow_send
    if me == 0:
        group_ops.barrier = late
    try:
        group = global_process_set.communicator.group("engine")
        return step_timing.probe_links(group, ["a", "b", "c"], nbytes=LATE_PROBE_BYTES)
    finally:
        group_ops.barrier, group_ops.send = barrier, send


LATE_PROBE_BYTES = 256 * 1024


class _Late:
    """A send over a slow link: it starts 0.5 s after it was posted, on a thread of its own."""

    def __init__(self, send: Callable[[], Any]) -> None:
        self.work: Any = None
        self.thread = threading.Thread(target=self._run, args=(send,))
        self.thread.start()

    def _run(self, send: Callable[[], Any]) -> None:
        time.sleep(0.5)
        self.work = send()

    def wait(self) -> None:
        self.thread.join()
        self.work.wait()


def test_a_leader_late_to_the_probe_does_not_slow_the_link_it_measures(world3: World) -> None:
    """Timed from each receiver's own start, the transfer from late rank 0 to b took its 1 s
    lateness (b measured slow), and the one from c to rank 0 had arrived before rank 0 looked
    (c measured fast): the report named host b for c's slow link."""
    rates = world3.run(_probe_with_a_slow_host_and_a_late_leader, timeout=60)
    assert rates[0] == rates[1] == rates[2]
    links = rates[0]
    assert links["c"] < SLOW_LINK_FACTOR * min(links["a"], links["b"]), links


def _slow_rank_is_reported() -> tuple[str, tuple[int, ...]]:
    comm = global_process_set.communicator
    timer = step_timing.StepTimer(
        every=4,
        rank=rt.rank(),
        host=f"h{rt.rank()}",
        host_of_rank=[f"h{r}" for r in range(rt.size())],
        group=comm.group("engine"),
    )
    try:
        model = __import__("torch").nn.Linear(4, 4)
        for _ in range(5):  # the first step only starts the clock
            model(__import__("torch").ones(1, 4))
            time.sleep(0.15 if rt.rank() == 1 else 0.01)  # rank 1 computes slowly
            timer.wait_started()
            rt.barrier()  # everyone waits for the slow rank here, as in a gradient allreduce
            timer.wait_done()
            timer.step_done()
    finally:
        timer.close()
    report = step_timing.last_report()
    assert report is not None
    return report.kind, report.ranks


def test_compute_bound_rank_is_named(world2: World) -> None:
    results = world2.run(_slow_rank_is_reported, timeout=60)
    assert results == [("compute", (1,))] * 2


def _outer_waits_are_reported_both_ways() -> list[str]:
    return [_outer_waits_are_reported(local) for local in (True, False)]


def _outer_waits_are_reported(local: bool) -> str:
    """Every step waits for its peers outside the gradient exchange (as local updates' outer
    steps do) far longer than it computes."""
    comm = global_process_set.communicator
    timer = step_timing.StepTimer(
        every=3,
        rank=rt.rank(),
        host="h",
        host_of_rank=["h"] * rt.size(),
        group=comm.group("engine"),
    )
    try:
        for _ in range(4):  # the first step only starts the clock
            # The outer step: its whole time waits for the peers, measured as the engine does
            # (a busy machine can oversleep by tens of ms: counted as compute, that once made
            # the rank that overslept a compute straggler).
            start = time.perf_counter()
            time.sleep(0.1)
            timer.waited(time.perf_counter() - start)
            timer.step_done(local=local)
    finally:
        timer.close()
    report = step_timing.last_report()
    assert report is not None and report.kind == "network"
    return report.line()


def test_a_network_verdict_of_local_updates_names_the_outer_exchange(world2: World) -> None:
    local, synced = world2.run(_outer_waits_are_reported_both_ways, timeout=60)[0]
    assert "outer_compression='int4'" in local and "--compression" not in local
    assert "--compression" in synced and "outer_compression" not in synced
