"""A rank's place in its process set is looked up once, not per collective: at 1,024 ranks a
scan of the set's ranks on every op would cost a high rank more Python than the op's own path
(issue 38)."""

from __future__ import annotations

from typing import Any

import pytest

from ringtrain.errors import CollectiveArgumentError
from ringtrain.runtime.communicator import Communicator


class _NoScan(tuple):  # type: ignore[type-arg]
    """The set's ranks, refusing the scans a per-op lookup would make."""

    def __contains__(self, item: Any) -> bool:
        raise AssertionError("the ranks were scanned")

    def index(self, *args: Any) -> int:
        raise AssertionError("the ranks were scanned")


def test_the_rank_s_place_in_its_set_is_known_without_scanning_the_ranks() -> None:
    comm = Communicator(0, range(1024), 1023, {}, is_world=True)
    comm.ranks = _NoScan(comm.ranks)
    assert comm.included and comm.set_rank == 1023 and comm.size == 1024


def test_a_rank_outside_the_set() -> None:
    comm = Communicator(1, [0, 1], 5, {}, is_world=False)
    assert not comm.included
    with pytest.raises(CollectiveArgumentError, match="not a member of process set 1"):
        comm.set_rank  # noqa: B018
