"""One collective name on different process sets fails as a mismatch on every rank, not a stall."""

from __future__ import annotations

import time

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives.crossset import Board, Stuck, set_mismatches
from ringtrain.errors import CollectiveMismatchError
from ringtrain.testing.spawn import World

WORLD = (0, 1, 2)
PAIR = (0, 1)


def test_same_name_on_two_sets_each_missing_the_other_is_a_mismatch() -> None:
    # Rank 0 went to the pair (set 1), ranks 1 and 2 to the world (set 0).
    on_world = Stuck("x", 0, WORLD, (1, 2))
    on_pair = Stuck("x", 1, PAIR, (0,))
    world_view = set_mismatches(0, [on_world], {0: [on_pair]})
    pair_view = set_mismatches(1, [on_pair], {1: [on_world]})
    assert list(world_view) == list(pair_view) == ["x"]
    for msg in (world_view["x"], pair_view["x"]):
        assert "'x' was submitted on different process sets" in msg
        assert (
            "ranks [1, 2] on process set 0 (ranks [0, 1, 2]), which also waits for ranks [0]" in msg
        )
        assert "ranks [0] on process set 1 (ranks [0, 1]), which also waits for ranks [1]" in msg
        assert "HINT:" in msg


def test_a_slow_rank_or_an_unrelated_wait_is_no_mismatch() -> None:
    on_world = Stuck("x", 0, WORLD, (1, 2))
    # Rank 0 posted nothing: it is only slow (a stall, reported by the stall inspector).
    assert set_mismatches(0, [on_world], {}) == {}
    # Rank 0 is stuck on another name elsewhere.
    assert set_mismatches(0, [on_world], {0: [Stuck("y", 1, PAIR, (0,))]}) == {}
    # Rank 0 is stuck on "x" on the pair, but only for rank 1's sake, who has not submitted
    # it there yet and did not submit it here either: one set is just behind the other.
    assert set_mismatches(0, [Stuck("x", 0, WORLD, (2,))], {0: [on_world]}) == {}
    # A post about the same set is this set's own wait, not another set's.
    assert set_mismatches(0, [on_world], {0: [Stuck("x", 0, WORLD, (0,))]}) == {}


class _Store:
    """The three calls the board makes on a torch store, counted."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.sets = 0

    def set(self, key: str, value: str | bytes) -> None:
        self.sets += 1
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


def test_the_board_posts_only_changes_and_reads_back_what_was_posted() -> None:
    store = _Store()
    mine, other = Board(store, 0), Board(store, 1)
    assert other.read(0) == ()  # never posted
    mine.update(0, [])
    assert store.sets == 0  # nothing stuck, nothing written
    stuck = [Stuck("x", 1, PAIR, (0,))]
    mine.update(1, stuck)
    mine.update(1, stuck)
    assert store.sets == 1
    assert other.read(0) == tuple(stuck)
    # Stuck on two sets at once: one post holds both.
    on_world = Stuck("y", 0, WORLD, (0, 2))
    mine.update(0, [on_world])
    assert set(other.read(0)) == {on_world, *stuck}
    mine.update(1, [])
    assert other.read(0) == (on_world,)
    mine.update(0, [])
    assert other.read(0) == ()


def test_a_broken_store_or_post_is_no_evidence_and_no_failure() -> None:
    class Broken(_Store):
        def set(self, key: str, value: str) -> None:
            raise RuntimeError("store gone")

    store = Broken()
    board = Board(store, 0)
    board.update(1, [Stuck("x", 1, PAIR, (0,))])  # does not raise
    store.data["ringtrain/stuck/1"] = b"not json"
    assert board.read(1) == ()


def _two_sets_one_name() -> tuple[str, float, str]:
    pair = rt.add_process_set(list(PAIR))
    if rt.rank() in PAIR:  # one board per process, or two sets' posts would overwrite each other
        world_ctl = rt.global_process_set.communicator.service("controller")
        assert pair.communicator.service("controller").board is world_ctl.board
    rt.allreduce(torch.ones(1), name="start")
    t0 = time.monotonic()
    ps = pair if rt.rank() == 0 else rt.global_process_set
    with pytest.raises(CollectiveMismatchError) as err:
        rt.allreduce(torch.ones(2), name="x", process_set=ps)
    took = time.monotonic() - t0
    # Both controllers live on. (Not under the name "x" at once: each set fails it on its own
    # schedule, and the world's old "x" may still wait for rank 0 when the pair's error arrives.)
    total = rt.allreduce(torch.ones(1), op=rt.Sum, name="after")
    rt.remove_process_set(pair)
    return str(err.value), took, f"{int(total.item())}"


def test_every_rank_gets_the_error_within_seconds(world3: World) -> None:
    results = world3.run(_two_sets_one_name, timeout=60)
    for msg, took, total in results:
        assert took < 20.0, took  # a stall is reported after the stall time (60 s)
        assert "'x' was submitted on different process sets" in msg, msg
        assert "ranks [1, 2] on process set 0" in msg and "ranks [0] on process set 1" in msg
        assert total == "3"
