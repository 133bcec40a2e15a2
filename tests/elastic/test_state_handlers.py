"""Horovod's elastic state handlers (``horovod.torch.elastic.state``): a program's own handler,
registered as Horovod's users register theirs, keeps its value in place across commit, restore
and sync; the registry can be replaced; a checkpoint refuses a value it could not save."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ringtrain as rt
import ringtrain.torch as hvd
import ringtrain.torch.elastic.state as hvd_state
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World


class Counter:
    """A value with no state_dict: only a handler of its own keeps it in place."""

    def __init__(self, n: int) -> None:
        self.n = n


class CounterHandler(hvd_state.StateHandler[Counter]):
    """Written as Horovod's handlers are: its own fields set after the base's __init__."""

    def __init__(self, counter: Counter) -> None:
        super().__init__(counter)
        self.saved = counter.n

    def save(self) -> None:
        self.saved = self.value.n

    def restore(self) -> None:
        self.value.n = self.saved

    def sync(self) -> None:
        self.value.n = hvd.broadcast_object(self.value.n, root_rank=0)


def _own_handler() -> dict[str, object]:
    registry = hvd_state.get_handler_registry()
    before = list(registry)
    registry.append((Counter, CounterHandler))
    try:
        counter = Counter(10 * (rt.rank() + 1))
        model = torch.nn.Linear(2, 1)
        state = hvd.elastic.TorchState(model=model, counter=counter, epoch=0)
        state.sync()
        synced = counter.n
        counter.n += 1
        state.commit()
        counter.n = 99
        state.restore()
        restored, same = counter.n, state.counter is counter
        state.counter = Counter(5)  # a new value is committed at once
        state.counter.n = 6
        state.restore()
        return {"synced": synced, "restored": restored, "same": same, "new": state.counter.n}
    finally:
        hvd_state.set_handler_registry(before)


def test_a_registered_handler_keeps_its_value_in_place(world2: World) -> None:
    for res in world2.run(_own_handler):
        assert res == {"synced": 10, "restored": 11, "same": True, "new": 5}, res


def test_an_empty_registry_keeps_everything_as_plain_values() -> None:
    before = hvd_state.get_handler_registry()
    hvd_state.set_handler_registry([])
    try:
        assert hvd_state.get_handler_registry() == []
        model = torch.nn.Linear(2, 1)
        state = hvd.elastic.TorchState(model=model, epoch=0)
        assert state._handlers == {}
        with torch.no_grad():
            model.weight.fill_(3.0)
        state.restore()  # a plain value comes back as a copy, not into the same object
        assert state.model is not model and bool((state.model.weight != 3.0).all())
    finally:
        hvd_state.set_handler_registry(before)
    kept = hvd.elastic.TorchState(model=torch.nn.Linear(2, 1))
    assert isinstance(kept._handlers["model"], hvd_state.ModelStateHandler)


def test_a_checkpoint_refuses_a_handled_value_it_cannot_save(tmp_path: Path) -> None:
    registry = hvd_state.get_handler_registry()
    registry.append((Counter, CounterHandler))
    try:
        state = hvd.elastic.TorchState(model=torch.nn.Linear(2, 1), counter=Counter(1))
    finally:
        registry.remove((Counter, CounterHandler))
    with pytest.raises(ConfigError, match=r"'counter' \(Counter, kept by CounterHandler\) has no"):
        state.save_checkpoint(str(tmp_path))
