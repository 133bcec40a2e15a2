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
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _local import H, Tiny, _adam_local, _alike, _step, delay_exchanges

import ringtrain as rt
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
