"""lane.wait_for, the lane's timed wait: a wait that runs out just before the work completes is
not the work's failure. Before, every claimant of such a slot failed with "a collective failed in
transit ... (RuntimeError: Operation timed out!)": seen at 4 ranks, in runs of the lane's mismatch
test with random delays on its paths, where the last rank claimed 0.25 s after the others."""

from __future__ import annotations

import datetime

import pytest

from ringtrain.collectives import lane


class FakeWork:
    """A torch work as c10d's Work.wait(timeout) treats it: a wait that runs out raises
    "Operation timed out!"; ``completes_after_timeout``: the work completes right after."""

    def __init__(self, done: bool = False, error: str = "", completes_after_timeout: bool = False):
        self.done, self.error, self.late = done, error, completes_after_timeout

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self.done:
            assert timeout is not None, "an untimed wait on a work that never completes"
            self.done = self.late  # completes between the timeout and the caller's next look
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_a_completed_work_is_done() -> None:
    assert lane.wait_for(FakeWork(done=True), lane.NUDGE_S)


def test_a_running_work_is_not_done_yet() -> None:
    assert not lane.wait_for(FakeWork(), lane.NUDGE_S)
    assert not lane.wait_for(FakeWork(), 0.01)


def test_a_work_that_completes_just_after_the_wait_ran_out_is_done_not_failed() -> None:
    assert lane.wait_for(FakeWork(completes_after_timeout=True), lane.NUDGE_S)


def test_a_failed_work_raises_its_own_error() -> None:
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        lane.wait_for(FakeWork(done=True, error="Connection closed by peer"), lane.NUDGE_S)
