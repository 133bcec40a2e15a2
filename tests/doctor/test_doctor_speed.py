"""The doctor says what batch_shares would gain, from each host's measured compute rate."""

from __future__ import annotations

import pytest

from ringtrain.doctor import report, speed


def _allreduce(
    rank_hosts: list[str], gflops: list[float], samples: list[list[float]] | None = None
) -> dict[str, object]:
    doc = {"allreduce": [{"bytes": 1}], "rank_hosts": rank_hosts, "compute_gflops": gflops}
    return doc if samples is None else {**doc, "compute_samples": samples}


def test_a_host_at_half_speed_gets_a_third_of_each_batch() -> None:
    probes = [[19.5, 20.0, 20.5], [9.8, 10.0, 10.2]]
    got = speed.examine(_allreduce(["a", "b"], [20.0, 10.0], probes), {"a": 1, "b": 1})
    assert got["skipped"] is None
    assert got["host_gflops"] == {"a": 20.0, "b": 10.0}
    assert got["shares"] == [67, 33] and got["sure"] is True
    assert got["gain"] == pytest.approx(1.5) and got["compute_vs_equal"] == pytest.approx(2 / 3)
    assert got["line"] == (
        "batch_shares would gain 1.50x samples/s: a step's compute 0.67x that at equal shares "
        "with shares in proportion to each rank's speed; set batch_shares=[67, 33] (rank order) "
        "or 'auto' (sure: each of 3 probes per rank was faster on a than any on b (GFLOP/s per "
        "rank: a 19.5-20.5, b 9.8-10.2))"
    )


def test_ranks_share_their_host_s_rate_in_the_planned_placement() -> None:
    # Measured: one rank per host; planned: 2 ranks on a, 1 on b (hosts filled in order).
    hosts = speed.host_rates(["a", "b"], [20.0, 10.0])
    assert speed.rank_rates(hosts, {"a": 2, "b": 1}) == [10.0, 10.0, 10.0]
    got = speed.examine(_allreduce(["a", "b"], [20.0, 10.0]), {"a": 2, "b": 1})
    assert got["shares"] == [33, 33, 33] and got["gain"] == pytest.approx(1.0)
    assert got["line"].startswith("ranks even in speed: shares by speed [33, 33, 33] would gain")
    # The one-host job: its 2 ranks' rates add up to the host's.
    assert speed.host_rates(["h", "h"], [6.0, 5.0]) == {"h": 11.0}
    assert speed.rank_rates({"a": 1.0}, {"a": 1, "c": 1}) is None  # c not measured


def test_the_report_shows_the_line_or_why_not() -> None:
    section = speed.examine(
        _allreduce(["a", "b", "c"], [10.0, 10.0, 5.0]), {"a": 1, "b": 1, "c": 1}
    )
    lines = speed.render(section)
    assert lines[0] == "Compute (fp32 matrix multiply, GFLOP/s per host): a 10.0, b 10.0, c 5.0"
    assert "set batch_shares=[40, 40, 20]" in lines[1]
    assert speed.examine({"allreduce": []}, {"a": 1})["skipped"].startswith("no compute")
    assert speed.render(None) == []
    doc = {"compute": section}
    assert report._compute(doc) == lines
    with pytest.raises(ValueError, match="2 rates for 3 ranks"):
        speed.host_rates(["a", "b", "c"], [1.0, 2.0])
