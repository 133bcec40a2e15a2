"""The straggler report says what shares of the global batch by speed would gain."""

from __future__ import annotations

import pytest

from ringtrain.diagnostics import shares
from ringtrain.diagnostics.straggler import RankTimes, analyse, shares_gain


def test_shares_in_proportion_to_speed_and_their_gain() -> None:
    fractions, gain = shares_gain([0.2, 0.4])  # rank 1 at half speed
    assert fractions == pytest.approx([2 / 3, 1 / 3])
    assert gain == pytest.approx(1.5)  # 1.0x one fast rank's pace -> 1.5x
    fractions, gain = shares_gain([0.2, 0.2, 0.2, 0.4])  # one slow rank of 4
    assert gain == pytest.approx(0.4 * (3 / 0.2 + 1 / 0.4) / 4)
    assert shares_gain([0.3, 0.3])[1] == pytest.approx(1.0)


def test_predicted_step_times_keep_the_exposed_communication() -> None:
    got = shares.predict([0.2, 0.2, 0.4], comm_s=0.1)  # 3 ranks, one at half speed
    assert got.equal_step_s == pytest.approx(0.5)
    assert got.shared_step_s == pytest.approx(3 / (5 + 5 + 2.5) + 0.1)
    assert got.gain == pytest.approx(0.5 / (0.24 + 0.1))
    assert got.shares == (40, 40, 20)
    assert shares.from_rates([10.0, 5.0]) == shares.predict([0.1, 0.2])
    assert shares.predict([1.0, 1000.0]).shares == (100, 1)  # every rank keeps a share
    line = got.line()
    assert "1.47x samples/s: a step 0.500 s with equal shares, 0.340 s" in line
    assert "set batch_shares=[40, 40, 20] (rank order) or 'auto'" in line
    assert "\n" not in line
    with pytest.raises(ValueError, match="positive"):
        shares.predict([0.2, 0.0])
    with pytest.raises(ValueError, match=">= 0"):
        shares.predict([0.2], comm_s=-1.0)


def test_the_compute_verdict_names_the_shares_on_a_line_of_its_own() -> None:
    times = [RankTimes(0, "a", 0.0, 0.2, 0.3), RankTimes(1, "b", 0.0, 0.4, 0.1)]
    report = analyse(times)
    assert report.kind == "compute"
    last = report.line().splitlines()[-1]
    # equal: the slow rank's 0.4 s + its 0.1 s of communication; in proportion 2/(5+2.5) + 0.1
    assert last == (
        "batch_shares would gain 1.36x samples/s: a step 0.500 s with equal shares, 0.367 s "
        "with shares in proportion to each rank's speed; set batch_shares=[67, 33] (rank "
        "order) or 'auto'"
    )
