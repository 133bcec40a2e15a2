"""Rank 0 spaces a durable job's checks about ``EVERY_S`` apart, by the steps it measured
(``checkpoint/step_checks.py``); the spacing travels in the checks, so every rank agrees on
it (tests/checkpoint/test_durable_seconds.py shows the ranks agreeing)."""

from __future__ import annotations

from ringtrain.checkpoint.step_checks import EVERY_S, MOST_STEPS, StepChecks


def test_rank_0_spaces_the_checks_a_quarter_second_apart() -> None:
    now = [0.0]
    checks = StepChecks(clock=lambda: now[0])
    assert checks._gap(1, rank=0) == 1  # nothing measured yet: the next step
    now[0] += 0.001 * 100  # 100 steps of 1 ms
    assert checks._gap(101, rank=0) == round(EVERY_S / 0.001) == 250
    now[0] += 0.4 * 2  # steps longer than the spacing: every step
    assert checks._gap(103, rank=0) == 1
    now[0] += 1e-6 * 10  # steps of a microsecond: at most MOST_STEPS apart
    assert checks._gap(113, rank=0) == MOST_STEPS
    assert checks._gap(200, rank=1) == 0  # only rank 0's choice counts
