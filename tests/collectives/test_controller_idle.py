"""An idle job costs no CPU: controllers doze on a doorbell and wake for the next collective."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import psutil
import torch
import torch.distributed as dist

import ringtrain as rt
from ringtrain.collectives import controller
from ringtrain.config import Config
from ringtrain.testing.spawn import World


def _cpu_s() -> float:
    t = psutil.Process(os.getpid()).cpu_times()
    return float(t.user + t.system)


def _idle_then_busy() -> tuple[int, float]:
    ctl = rt.global_process_set.communicator.service("controller")
    for episode in range(1, 4):  # several naps: each wakes for the next op, on every rank
        assert rt.allreduce(torch.ones(3), name="ping", op=rt.Sum).tolist() == [rt.size()] * 3
        deadline = time.monotonic() + 20
        while rt.size() > 1 and ctl._doorbell.naps < episode:
            assert time.monotonic() < deadline, "the controllers never dozed"
            time.sleep(0.05)
    before = _cpu_s()
    time.sleep(1.0)
    spent = _cpu_s() - before
    rt.barrier()  # one rank asks, all wake; shutdown afterwards must not hang either
    return ctl._doorbell.naps, spent


def test_idle_controllers_doze_and_wake(world: World) -> None:
    for naps, cpu_s in world.run(_idle_then_busy, timeout=90):
        if world.size > 1:
            assert naps >= 3
        assert cpu_s < 0.1, f"{cpu_s:.3f} s of CPU in 1 s of idling"


def _one_rank_wakes_the_others() -> float:
    time.sleep(1.0)  # every controller dozes
    if rt.rank() == 0:
        time.sleep(0.5)  # the others submit first (and ring); rank 0 then must not wait a poll
    t = time.perf_counter()
    rt.allreduce(torch.ones(1), name="late")
    return time.perf_counter() - t


def test_a_late_rank_wakes_dozing_peers(world3: World) -> None:
    times = world3.run(_one_rank_wakes_the_others, timeout=60)
    assert times[0] < 2.0, times  # rank 0 did not wait for a poll interval or a timeout


def _settle_after_an_op() -> tuple[bool, float]:
    ctl = rt.global_process_set.communicator.service("controller")
    rt.allreduce(torch.ones(3), name="before-quiet")
    t = time.monotonic()
    settled = ctl.settle(timeout=5.0)
    waited = time.monotonic() - t
    # No rank may shut down (which wakes every controller) before all have seen the doze.
    dist.barrier()
    return settled, waited


def test_controllers_stop_polling_soon_after_an_op(world: World) -> None:
    # Idle rounds cost CPU that the process's next work (its compute, its torch collectives)
    # needs: a few rounds, far apart, then the doze.
    nap = controller.Controller._nap_s(SimpleNamespace(config=Config()))  # type: ignore[arg-type]
    quiet = nap * controller.DOZE_AFTER_IDLE_CYCLES
    assert controller.DOZE_AFTER_IDLE_CYCLES <= 8 and quiet <= 0.25, quiet
    for settled, waited in world.run(_settle_after_an_op, timeout=60):
        assert settled
        assert waited < 2.0, f"controllers polled for {waited:.2f} s after the last op"
