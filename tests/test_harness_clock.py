"""The per-test timeout stops while a test world's ranks start (tests/conftest.py)."""

from __future__ import annotations

import time
import types

import pytest

from ringtrain.testing import spawn


@pytest.mark.timeout(2)
def test_waiting_for_ranks_to_start_is_off_the_clock() -> None:
    # A start slower than the whole timeout: the test survives it and its clock starts again.
    world = types.SimpleNamespace(_wait_ranks_up=lambda: time.sleep(4))
    spawn.World._wait_started(world)  # type: ignore[arg-type]
    assert spawn.start_hooks, "tests/conftest.py registers the clock's pause and resume"
