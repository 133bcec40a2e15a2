"""A shut-down controller is freed at once (reference counting, no cyclic collector): it holds
the process groups, whose Gloo sockets would otherwise stay open into the next init (found by
tests/runtime/test_sockets.py when a shared world ran another test first)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives.async_ops import controller_of
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(120)


def _freed_at_shutdown() -> bool:
    for _ in range(3):  # a repeated request: the fast lane opens and its slots are used
        rt.allreduce(torch.ones(8), name="again")
    ctl = weakref.ref(controller_of(None))
    gc.collect()
    gc.disable()
    try:
        rt.shutdown()
        return ctl() is None
    finally:
        gc.enable()


def test_the_controller_and_its_lane_driver_go_with_shutdown() -> None:
    assert spawn.world(2).run(_freed_at_shutdown) == [True, True]
