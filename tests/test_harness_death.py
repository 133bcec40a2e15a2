"""A test world's rank that dies reports how: its signal and the fatal error's first line."""

from __future__ import annotations

import os
import signal

import pytest

from ringtrain.testing import spawn


def _crash() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)  # as a crash inside a C extension ends a rank


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_is_reported_with_it() -> None:
    world = spawn.World(2)
    try:
        with pytest.raises(spawn.RankFailed) as failed:
            world.run(_crash, timeout=60)  # inside init(), which turns faulthandler on
    finally:
        world.close()
    text = str(failed.value)
    # A long thread dump pushes faulthandler's header out of the log's tail: named on its own.
    assert "rank 0 died (signal SIGSEGV: Fatal Python error: Segmentation fault)" in text, text
