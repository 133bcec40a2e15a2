"""A handle's completion reaches every waiter (collectives/handles.py), pure.

A handle makes its wake-up Event only when a waiter must block; these tests pin the hand-over
between the completing thread and the waiters: a waiter that blocks first is woken, one that
comes after completion returns at once (and no Event is ever made), a timed wait that runs out
says so, and an error reaches every waiter."""

from __future__ import annotations

import threading

import pytest

from ringtrain.collectives.handles import CompositeHandle, Handle
from ringtrain.errors import CollectiveAbortedError, CollectiveError


def test_completed_before_the_wait_returns_at_once_without_an_event() -> None:
    h: Handle[int] = Handle("h", finish=lambda r: r + 1)
    h.set_result(41)
    assert h.done()
    assert h.wait(0) == 42
    assert h.wait() == 42  # finish ran once: the same result again
    assert h._event is None


@pytest.mark.timeout(30)
def test_waiters_that_block_first_are_woken_by_another_thread() -> None:
    h: Handle[str] = Handle("h")
    got: list[str] = []
    waiters = [threading.Thread(target=lambda: got.append(h.wait(20))) for _ in range(4)]
    for w in waiters:
        w.start()
    while h._event is None:  # at least one waiter is about to block (or has)
        threading.Event().wait(0.001)
    assert not h.done()
    h.set_result("sum")
    for w in waiters:
        w.join(20)
    assert got == ["sum"] * 4


def test_a_timed_wait_that_runs_out_says_so_and_the_handle_can_be_waited_again() -> None:
    h: Handle[int] = Handle("slow")
    with pytest.raises(CollectiveAbortedError, match="did not complete within"):
        h.wait(0.01)
    h.set_result(1)
    assert h.wait(0.01) == 1


@pytest.mark.timeout(30)
def test_an_error_reaches_a_blocked_waiter_and_later_ones() -> None:
    h: Handle[int] = Handle("bad")
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            h.wait(20)
        except CollectiveError as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    while h._event is None:
        threading.Event().wait(0.001)
    h.set_error(CollectiveError("rank 1 failed"))
    t.join(20)
    with pytest.raises(CollectiveError, match="rank 1 failed"):
        h.wait()
    assert [str(e) for e in errors] == ["rank 1 failed"]


def test_a_composite_handle_completes_once_from_its_parts() -> None:
    parts: list[Handle[int]] = [Handle("a"), Handle("b")]
    c = CompositeHandle("ab", parts, lambda a, b: a + b)
    assert not c.done()
    parts[0].set_result(1)
    parts[1].set_result(2)
    assert c.done()
    assert c.wait() == 3
    assert c.wait(0) == 3
