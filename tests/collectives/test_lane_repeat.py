"""A repeat of the fast lane's reservation (lane.Lane.repeat_of, async_ops._repeat): found by
comparing the call's arguments with the reserved request, it builds no request of its own, and
gives what the general path gives (results, the tensor handed back, views, autograd)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ringtrain as rt
from _repeats import N, check_spellings, counting, data, differing_calls
from ringtrain.collectives import async_ops, lane
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.testing import spawn

TIMEOUT = 150


def _reserved(lane_: lane.Lane, **changes: Any) -> Request:
    fields: dict[str, Any] = {"op": "Average", "prescale": 1.0, "postscale": 2.0}
    fields.update(changes)
    req = Request("w", "allreduce", (TensorMeta((64, 64), "torch.float32"),), **fields)
    assert lane_.open_at(0, req)
    return req


def test_a_repeat_is_found_by_every_argument_of_the_reserved_request() -> None:
    fast = lane.Lane(2, group=None)
    req = _reserved(fast)
    t = torch.zeros(64, 64)
    assert fast.repeat_of("w", t, "Average", 1.0, 2.0) is req
    assert fast.repeat_of("w", t.t(), "Average", 1.0, 2.0) is req  # strides: not in a request
    for name, tensor, op, pre, post in differing_calls(t):
        assert fast.repeat_of(name, tensor, op, pre, post) is None, (name, op, pre, post)


def test_no_repeat_without_a_reservation() -> None:
    fast = lane.Lane(2, group=None)
    assert fast.repeat_of("w", torch.zeros(64, 64), "Average", 1.0, 2.0) is None
    _reserved(fast)
    fast.reserved, fast._repeat = None, None  # as a lost slot gives it up (Lane._verdict)
    assert fast.repeat_of("w", torch.zeros(64, 64), "Average", 1.0, 2.0) is None


def _counted(steps: int) -> dict[str, Any]:
    """A loop of repeated lane ops in each spelling, counting the requests built meanwhile."""
    # A descheduled rank must not lose a slot (the test counts requests); the world is shared
    # with other tests, so the setting and the patch are taken back.
    saved, real, built = lane.RELEASE_S, async_ops.Request, [0]
    lane.RELEASE_S = 60.0
    try:
        got = _in_each_spelling(steps, counting(built))
    finally:
        lane.RELEASE_S, async_ops.Request = saved, real  # type: ignore[misc]
    r = rt.rank()
    grad = data(0, r).requires_grad_()
    summed = rt.allreduce(grad, name="grad", op=rt.Sum)  # autograd: the general path
    summed.sum().backward()
    got["grad"] = (summed.detach(), grad.grad)
    got["built"] = built[0]
    got["slots"] = rt.collectives.ops.controller_of(None).lane_slots
    return got


def _in_each_spelling(steps: int, counting: Any) -> dict[str, Any]:
    r = rt.rank()
    got: dict[str, Any] = {"inplace": [], "plain": [], "view": []}
    base = torch.zeros(2, N)
    for step in range(steps):
        if step == 2:  # each name ran once negotiated and once on the lane: count from here
            async_ops.Request = counting  # type: ignore[misc]
        t = data(step, r)
        same = rt.allreduce_(t, name="inplace", op=rt.Sum)
        got["inplace"].append((same is t, t.clone()))
        src = data(step, r)
        kept = src.clone()
        out = rt.allreduce(src, name="plain", op=rt.Average)
        got["plain"].append((out is not src and torch.equal(src, kept), out))
        base[1] = data(step, r)
        view = base[1]
        back = rt.synchronize(rt.allreduce_async_(view, name="view", op=rt.Average))
        got["view"].append((back is view, base[1].clone()))
    return got


@pytest.mark.parametrize("size", [2, 3])
def test_repeats_build_no_request_and_give_the_general_path_s_results(size: int) -> None:
    steps = 8
    results = spawn.world(size).run(_counted, steps, timeout=TIMEOUT, fast_lane=True)
    # Three names take turns: the lane follows one and the others are negotiated (one
    # reservation per set), with the requests they made before (test_resubmit.py). (A slot may
    # be lost where a rank is still busy with the previous negotiated op when a peer claims:
    # the op is then negotiated, with the same results.)
    for got in results:
        assert got["built"] == 0, got["built"]
        assert got["slots"][0] >= 1, got["slots"]
    for step in range(steps):
        check_spellings(results, step)
        total = sum(data(step, k) for k in range(size))
        for got in results:
            same, view = got["view"][step]
            assert same  # the view itself comes back, and its base holds the average
            torch.testing.assert_close(view, total / size, rtol=1e-5, atol=1e-4)
    for got in results:
        summed, grad = got["grad"]
        torch.testing.assert_close(summed, sum(data(0, k) for k in range(size)))
        assert torch.equal(grad, torch.full((N,), float(size)))  # Horovod: the grad is summed


def _one_name(steps: int) -> tuple[int, tuple[int, int]]:
    """One name repeated: after its first run, every op rides the lane with no request."""
    r = rt.rank()
    saved, real, built = lane.RELEASE_S, async_ops.Request, [0]
    lane.RELEASE_S = 60.0
    try:
        rt.allreduce_(data(0, r), name="w", op=rt.Sum)  # negotiated: opens the lane
        async_ops.Request = counting(built)  # type: ignore[misc]
        for step in range(1, steps):
            rt.allreduce_(data(step, r), name="w", op=rt.Sum)
    finally:
        lane.RELEASE_S, async_ops.Request = saved, real  # type: ignore[misc]
    return built[0], rt.collectives.ops.controller_of(None).lane_slots


def test_a_repeated_name_builds_no_request_after_its_first_run() -> None:
    for built, (valid, invalid) in spawn.world(2).run(
        _one_name, 20, timeout=TIMEOUT, fast_lane=True
    ):
        assert built == 0 and valid == 19 and invalid == 0, (built, valid, invalid)
