"""The supervisor's decision on a rank's exit, rule by rule, without starting any process."""

from __future__ import annotations

import pytest

from ringtrain.launch.exit_policy import Next, RankExit, decide

FAILED = RankExit(succeeded=False)


@pytest.mark.parametrize(
    ("exit", "expected"),
    [
        (RankExit(succeeded=True), Next.FINISHED),
        (FAILED, Next.FAIL),
        # A retired rank stopped on purpose, however it ended.
        (RankExit(succeeded=False, retired=True), Next.STOPPED),
        (RankExit(succeeded=True, retired=True), Next.STOPPED),
        # Ctrl-C: every end is the interrupt's.
        (RankExit(succeeded=False, interrupted=True), Next.IGNORE),
        # After the first failure: the ranks the launcher stopped are not failures...
        (RankExit(succeeded=False, job_failed=True, stopped_by_launcher=True), Next.IGNORE),
        # ... unless they said they were failing first; other ends are failures of their own.
        (
            RankExit(succeeded=False, job_failed=True, stopped_by_launcher=True, said_failing=True),
            Next.ALSO_FAILED,
        ),
        # ... or stopped on a preemption of their own, at the step saved: the job's stop.
        (
            RankExit(succeeded=False, job_failed=True, stopped_by_launcher=True, preempted=True),
            Next.ALSO_FAILED,
        ),
        (RankExit(succeeded=False, job_failed=True), Next.ALSO_FAILED),
        (RankExit(succeeded=True, job_failed=True), Next.FINISHED),
        # Elastic jobs re-form around a started rank that failed; a joiner failed to join.
        (RankExit(succeeded=False, elastic=True), Next.REFORM),
        (RankExit(succeeded=False, elastic=True, started=False), Next.FAIL),
        (RankExit(succeeded=False, elastic=True, joining=True), Next.JOINER_FAILED),
        (RankExit(succeeded=False, elastic=True, job_failed=True), Next.ALSO_FAILED),
    ],
)
def test_decide(exit: RankExit, expected: Next) -> None:
    assert decide(exit) is expected
