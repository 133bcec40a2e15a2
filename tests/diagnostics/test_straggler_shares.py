"""The straggler report says what shares of the global batch by speed would gain."""

from __future__ import annotations

import pytest

from ringtrain.diagnostics.straggler import RankTimes, analyse, shares_gain


def test_shares_in_proportion_to_speed_and_their_gain() -> None:
    shares, gain = shares_gain([0.2, 0.4])  # rank 1 at half speed
    assert shares == pytest.approx([2 / 3, 1 / 3])
    assert gain == pytest.approx(1.5)  # 1.0x one fast rank's pace -> 1.5x
    shares, gain = shares_gain([0.2, 0.2, 0.2, 0.4])  # one slow rank of 4
    assert gain == pytest.approx(0.4 * (3 / 0.2 + 1 / 0.4) / 4)
    assert shares_gain([0.3, 0.3])[1] == pytest.approx(1.0)


def test_the_compute_verdict_names_the_shares() -> None:
    times = [RankTimes(0, "a", 0.0, 0.2, 0.2), RankTimes(1, "b", 0.0, 0.4, 0.0)]
    report = analyse(times)
    assert report.kind == "compute"
    assert "batch_shares='auto' (about [0.67, 0.33])" in report.line()
    assert "busy part of a step about 1.50x" in report.line()
