"""A rank that skips an allreduce is reported by name; with a shutdown time, every rank fails."""

from __future__ import annotations

import logging

import pytest
import torch

import ringtrain as rt
from ringtrain.testing.spawn import RankFailed, World


def _skip_one() -> None:
    logging.basicConfig(level=logging.WARNING)
    if rt.rank() != 1:
        rt.allreduce(torch.ones(1), name="grad.skipped")
    else:
        # rank 1 never submits: it blocks in a later collective the others never reach
        rt.allreduce(torch.ones(1), name="grad.next")


def test_skipped_allreduce_reported_then_aborted(world3: World) -> None:
    with pytest.raises(RankFailed) as info:
        world3.run(_skip_one, timeout=40, stall_warning_s=1.0, stall_shutdown_s=3.0)
    msg = str(info.value)
    for r in range(3):
        assert f"--- rank {r} ---\nStallError" in msg, msg
    assert "rank 1 has not submitted: 'grad.skipped'" in msg
    assert "stopping the job" in msg
    with open(world3.logs[0]) as f:
        said = f.read()
    assert "stall:" in said, "rank 0 logged no stall warning before aborting"
    # Each side says where it is (diagnostics/whereabouts.py): rank 1 waits in another
    # collective, which ranks 0 and 2 have not submitted.
    with open(world3.logs[1]) as f:
        told = f.read()
    assert "rank 1 keeps its peers waiting: it has not submitted 'grad.skipped'" in told, told
    assert 'rt.allreduce(torch.ones(1), name="grad.next")' in told, told
    assert "(inside ringtrain: collectives/" in told, told
    assert "rank 0 keeps its peers waiting: it has not submitted 'grad.next'" in said, said


def test_log_level_error_hides_the_stall_warning_not_the_stall_error(world3: World) -> None:
    """docs/diagnostics.md: ``--log-level ERROR`` (RINGTRAIN_LOG_LEVEL) hides the warnings; the
    StallError at the shutdown time still ends the job."""
    with open(world3.logs[0]) as f:
        before = len(f.read())
    with pytest.raises(RankFailed) as info:
        world3.run(
            _skip_one, timeout=40, stall_warning_s=1.0, stall_shutdown_s=3.0, log_level="ERROR"
        )
    assert "--- rank 0 ---\nStallError" in str(info.value), str(info.value)
    with open(world3.logs[0]) as f:
        logged = f.read()[before:]
    assert "stall:" not in logged and "has not submitted" not in logged, logged
