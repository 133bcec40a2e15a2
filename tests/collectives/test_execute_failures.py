"""How the executor hands a failed op on (``Executor._settle``): an error of the op's own (a
mismatch) fails its handles and the controller goes on; a lost peer or a replaced world
(``CollectiveAbortedError``, which a sliced wait raises once the launcher announced a new world)
fails them and ends the controller, as a transport error does: its peers are gone."""

from __future__ import annotations

import pytest
import torch

from ringtrain.collectives.execute import Executor, _Item
from ringtrain.collectives.handles import Handle
from ringtrain.collectives.requests import Request
from ringtrain.errors import CollectiveAbortedError, CollectiveMismatchError


def _item() -> _Item:
    t = torch.ones(2)
    return _Item("x", Request(name="x", kind="allreduce"), [t], [t], Handle("x"), 2)


def _fail(error: Exception) -> None:
    raise error


def test_a_replaced_world_fails_the_ops_and_ends_the_controller() -> None:
    items = [_item(), _item()]
    aborted = CollectiveAbortedError("a peer failed: the launcher announced a new world")
    with pytest.raises(CollectiveAbortedError):  # out of the executor: the controller ends
        Executor._settle(None, items, lambda: _fail(aborted))  # type: ignore[arg-type]
    for item in items:
        assert item.handle is not None
        with pytest.raises(CollectiveAbortedError, match="announced a new world"):
            item.handle.wait()


def test_an_ops_own_error_fails_it_and_the_controller_goes_on() -> None:
    item = _item()
    mismatch = CollectiveMismatchError("rank 1 asked for another shape")
    Executor._settle(None, [item], lambda: _fail(mismatch))  # type: ignore[arg-type]
    assert item.handle is not None
    with pytest.raises(CollectiveMismatchError):
        item.handle.wait()
