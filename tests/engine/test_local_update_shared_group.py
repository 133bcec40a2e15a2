"""Two local-update optimizers on one group: an overlapped outer exchange still on the wire and
the other optimizer's collectives (its anchor agreement, its own exchange) queue in the main
thread's order on every rank, whatever each rank's timing.

The ring's messages all use tag 0, so two exchanges queued in another order on one rank take
each other's bytes (silently where their sizes match, or Gloo aborts). Shown with two models
stepping in turn (a GAN's pattern), rank 0's exchanges of the first delayed, against the same
run undelayed: the same anchors, bit for bit, alike on every rank. The resume in one process
(a second optimizer built while the first's last exchange is in flight) is
``test_local_update.py``'s resume test.

The worker is a daemon thread, so a process that leaves waits for what was queued on it (the
script's last exchange, which its peers are running): a job of ``ringtrain run`` whose script
ends with an exchange that takes longer than the exit guard's wait ends cleanly, the exchange
complete on every rank.

The same holds for a bare ``sync_every``'s link probe, queued at its first step and not waited
for, against a plain optimizer's plan (gathered on the same group at its first step).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _local import H, Tiny, _adam_local, _alike, _step, _weights, delay_exchanges

import ringtrain as rt
from ringtrain.engine import auto
from ringtrain.runtime import exit_guard
from ringtrain.testing import spawn

JOB = Path(__file__).with_name("exit_in_flight_job.py")

ROUNDS = 3


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _pair(delay: float) -> dict[str, Any]:
    """Models A and B, each with an overlapped int8 local update on the engine group, stepped in
    turn; on rank 0 every exchange of A's sleeps ``delay`` s before it sends."""
    model_a, opt_a = _adam_local(outer_compression="int8", outer_overlap=True)
    torch.manual_seed(1)
    model_b = Tiny()
    opt_b = rt.DistributedOptimizer(
        torch.optim.Adam(model_b.parameters(), lr=0.01),
        named_parameters=model_b.named_parameters(),
        sync_every=H,
        outer_compression="int8",
        outer_overlap=True,
    )
    local_a, local_b = opt_a.local_update, opt_b.local_update
    assert local_a is not None and local_b is not None
    if rt.rank() == 0 and delay:
        delay_exchanges(local_a, delay)
    alike = []
    for i in range(H * ROUNDS + 1):
        _step(model_a, opt_a, i)
        _step(model_b, opt_b, i)
        if (i + 1) % H == 1 and i > 0:  # the exchange of the round before has merged
            assert local_a.anchor is not None and local_b.anchor is not None
            alike.append(_alike(_flat(local_a.anchor)) and _alike(_flat(local_b.anchor)))
    assert local_a.anchor is not None and local_b.anchor is not None
    return {"alike": alike, "a": _flat(local_a.anchor), "b": _flat(local_b.anchor)}


@pytest.mark.timeout(300)
def test_two_optimizers_exchanges_queue_alike_on_every_rank() -> None:
    world = spawn.world(2)
    quick = world.run(_pair, 0.0, timeout=240)
    late = world.run(_pair, 0.3, timeout=240)
    for r in quick + late:
        assert r["alike"] and all(r["alike"]), r["alike"]
    assert torch.equal(quick[0]["a"], late[0]["a"])
    assert torch.equal(quick[0]["b"], late[0]["b"])


def _local_beside_plain(probe_delay: float, plain_first: bool) -> dict[str, Any]:
    """A GAN's pattern: a bare ``sync_every=H`` (its link probe queued on the engine group's
    worker at its first step, not waited for) and a plain optimizer (its plan gathered on that
    group at its first step), stepped in turn; rank 0's probe starts ``probe_delay`` s late."""
    probe = auto.probe_link

    def late(*args: Any) -> tuple[float, float]:
        time.sleep(probe_delay)
        return probe(*args)

    if rt.rank() == 0:
        auto.probe_link = late
    try:
        model_a, opt_a = _adam_local()  # outer_compression not given: the first round measures
        torch.manual_seed(1)
        model_b = Tiny()
        opt_b = rt.DistributedOptimizer(
            torch.optim.Adam(model_b.parameters(), lr=0.01),
            named_parameters=model_b.named_parameters(),
        )
        for i in range(2 * H):
            if plain_first:
                _step(model_b, opt_b, i)
            _step(model_a, opt_a, i)
            if not plain_first:
                _step(model_b, opt_b, i)
    finally:
        auto.probe_link = probe
    local = opt_a.local_update
    assert local is not None and local.anchor is not None
    return {"measured": local.outer_reason != "", "a": _flat(local.anchor), "b": _weights(model_b)}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("plain_first", [False, True])
def test_a_link_probe_in_flight_and_another_optimizers_plan_queue_alike(plain_first: bool) -> None:
    every = spawn.world(2).run(_local_beside_plain, 0.3, plain_first, timeout=90)
    for r in every:
        assert r["measured"]
        assert torch.equal(r["a"], every[0]["a"])
        assert torch.equal(r["b"], every[0]["b"])


@pytest.mark.timeout(240)
def test_a_script_that_ends_with_an_exchange_in_flight_lets_it_end(tmp_path: Path) -> None:
    late = exit_guard.EXIT_WAIT_S + 2  # longer than the exit guard waits for a native call
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "-x", "OMP_NUM_THREADS=1"]
    argv += ["--", sys.executable, str(JOB), str(tmp_path), str(late)]
    # Its own session: a job that does not end is stopped with its ranks.
    job = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        said, _ = job.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(f"the job did not end:\n{job.communicate()[0]}") from None
    assert job.returncode == 0, said
    assert "rank 0 done" in said and "rank 1 done" in said, said
    assert "may still be inside a torch call" not in said, said
    for rank in (0, 1):
        assert (tmp_path / f"ended.{rank}").read_text() == "yes", said
