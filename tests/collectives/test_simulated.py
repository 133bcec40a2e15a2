"""The simulated coordinator drives the real controller's rounds at N ranks in one process:
its counts follow from what the round does, and its ops run in the order every rank shares."""

from __future__ import annotations

import pytest

from ringtrain.collectives import control_round
from ringtrain.collectives.simulated import SimulatedRank, measure


@pytest.mark.parametrize("size", [3, 16])
def test_idle_round_counts_what_the_allgather_carries(size: int) -> None:
    f = measure(size, ops=0, rounds=3)
    # Today's round: one ring allgather of one fixed slot per rank, every message decoded.
    assert f.decodes == size
    assert f.wire_ops == 1
    assert f.steps == size - 1
    assert f.bytes_in == (size - 1) * control_round.CONTROL_SLOT_BYTES


def test_cached_ops_become_ready_and_run_in_submission_order() -> None:
    sim = SimulatedRank(8)
    names = [f"g.{i}" for i in range(10)]
    for _ in range(3):
        sim.submit(names)
        sim.round()
    assert sim.executor.order == names * 3
    assert not sim.controller.pending_names()
    # After the first round the requests travel as cache numbers.
    assert len(sim.controller._requests.cache) == len(names)


def test_a_simulated_set_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="at least 1 rank"):
        SimulatedRank(0)
