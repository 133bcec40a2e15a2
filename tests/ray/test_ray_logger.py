"""Horovod's ``ray_logger`` in the workers: what reaches the run's queue, and when it warns.
(The queue itself, the driver's callbacks and their order: tests/cluster/test_ray_cluster.py.)"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'ringtrain[ray]'")

from ringtrain.ray import ray_logger
from ringtrain.ray.callbacks import Logged


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
