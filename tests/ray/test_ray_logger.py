"""Horovod's ``ray_logger`` in the workers: what reaches the run's queue, and when it warns; the
driver's delivery to the callbacks over a stand-in for the Ray queue. (The Ray queue between
real workers and the driver: tests/cluster/test_ray_cluster.py.)"""

from __future__ import annotations

import logging
import queue as stdlib_queue
import threading
import time
import warnings

import pytest

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'ringtrain[ray]'")

from ray.util.queue import Empty

from ringtrain.ray import callbacks, ray_logger
from ringtrain.ray.callbacks import Delivery, Logged


class Queue:
    def __init__(self) -> None:
        self.items: list[dict] = []

    def put(self, value: dict) -> None:
        self.items.append(value)


def test_rank_0_logs_every_rank_with_chief_only_false(monkeypatch: pytest.MonkeyPatch) -> None:
    queue = Queue()
    monkeypatch.setenv("RINGTRAIN_RANK", "0")  # the rank it was started as (no hvd.init())
    Logged(lambda _: ray_logger.log({"a": 1}), queue)(None)
    monkeypatch.setenv("RINGTRAIN_RANK", "1")
    Logged(lambda _: ray_logger.log({"b": 2}), queue)(None)
    Logged(lambda _: ray_logger.log({"c": 3}, chief_only=False), queue)(None)
    assert queue.items == [{"a": 1}, {"c": 3}]


def test_rank_0_is_the_rank_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Started as rank 1, renumbered 0 by a re-formed elastic world: it logs as rank 0."""
    import types

    from ringtrain.runtime import state

    queue = Queue()
    monkeypatch.setenv("RINGTRAIN_RANK", "1")
    monkeypatch.setattr(state, "is_initialized", lambda: True)
    monkeypatch.setattr(state, "current", lambda: types.SimpleNamespace(rank=0))
    Logged(lambda _: ray_logger.log({"a": 1}), queue)(None)
    assert queue.items == [{"a": 1}]


def test_a_call_without_callbacks_never_uses_an_earlier_runs_queue_and_warns_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ray_logger, "_warned", False)
    monkeypatch.setenv("RINGTRAIN_RANK", "0")
    queue = Queue()
    assert Logged(lambda _: ray_logger._queue, queue)(None) is queue
    assert ray_logger._queue is None  # the call ended: its queue is gone with it
    with pytest.warns(UserWarning, match="this run has no callbacks to take it"):
        Logged(lambda _: ray_logger.log({"d": 4}))(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Logged(lambda _: ray_logger.log({"e": 5}))(None)  # once only
    assert queue.items == []


class RayQueue:
    """The calls the driver makes of ``ray.util.queue.Queue``, in one process."""

    def __init__(self) -> None:
        self._items: stdlib_queue.Queue[object] = stdlib_queue.Queue()
        self.shut = False

    def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
        self._items.put(item)

    def get(self, block: bool = True, timeout: float | None = None) -> object:
        try:
            return self._items.get(timeout=timeout)
        except stdlib_queue.Empty:
            raise Empty from None

    def shutdown(self, force: bool = False, grace_period_s: int = 5) -> None:
        self.shut = True


@pytest.mark.timeout(30)
def test_every_value_reaches_the_callbacks_in_order_and_one_that_raises_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got: list[object] = []
    raised: list[object] = []

    def raising(value: object) -> None:
        raised.append(value)
        raise RuntimeError("a callback's own error")

    q = RayQueue()
    with caplog.at_level("ERROR", logger="ringtrain"), Delivery([raising, got.append], q):
        for i in range(5):
            q.put({"i": i})
            time.sleep(0.02)
        q.put({"i": "last"})  # logged just before the results are in: still delivered
    assert got == [{"i": i} for i in range(5)] + [{"i": "last"}]
    assert raised == [{"i": 0}]
    assert "callbacks[0]" in caplog.text and "a callback's own error" in caplog.text
    assert q.shut


@pytest.mark.timeout(30)
def test_a_callback_that_blocks_holds_the_run_at_most_drain_s(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(callbacks, "DRAIN_S", 0.5)
    release = threading.Event()
    q = RayQueue()
    delivery = Delivery([lambda _: release.wait(20)], q)
    try:
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="ringtrain"), delivery:
            q.put({"i": 0})
        assert time.monotonic() - started < 5.0
        assert "still busy 0 s after the run's results were in" in caplog.text, caplog.text
    finally:
        release.set()
        delivery._thread.join(20)
