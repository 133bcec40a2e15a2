"""The doctor recommends batch_shares only where the hosts differ by more than its compute
probe's own spread (a new-user trial: two identical namespace hosts sharing 2 cores read 73.5
and 86.9 GFLOP/s from one 0.3 s probe each, and were told to set batch_shares=[46, 54] for a
"1.09x" gain)."""

from __future__ import annotations

from ringtrain.doctor import probe, speed

# Two identical hosts on shared cores: five probes each, as noisy as the trial's single ones.
A = [73.5, 70.2, 88.1, 72.9, 74.0]  # median 73.5
B = [86.9, 71.8, 87.5, 85.0, 90.3]  # median 86.9


def _doc(samples: list[list[float]], hosts: list[str] | None = None) -> dict[str, object]:
    return {
        "allreduce": [{"bytes": 1}],
        "rank_hosts": hosts or ["h0", "h1"],
        "compute_gflops": [sorted(s)[len(s) // 2] for s in samples],
        "compute_samples": samples,
    }


def test_hosts_within_the_probes_spread_are_even() -> None:
    got = speed.examine(_doc([A, B]), {"h0": 1, "h1": 1})
    assert got["gain"] > speed.EVEN_GAIN  # the medians alone would recommend shares
    assert got["sure"] is False and got["probes"] == 5
    line = got["line"]
    assert line.startswith("ranks even in speed within the measurement's noise"), line
    assert "set batch_shares" not in line, line
    assert "5 probes per rank overlap (GFLOP/s per rank: h1 71.8-90.3, h0 70.2-88.1)" in line
    assert got["host_range"] == {"h0": [70.2, 88.1], "h1": [71.8, 90.3]}
    lines = speed.render(got)
    assert lines[0] == (
        "Compute (fp32 matrix multiply, GFLOP/s per host, median [range] of 5 probes): "
        "h0 73.5 [70.2-88.1], h1 86.9 [71.8-90.3]"
    )


def test_a_difference_beyond_the_spread_is_recommended_and_called_sure() -> None:
    slow = [v / 2 for v in A]
    got = speed.examine(_doc([slow, A]), {"h0": 1, "h1": 1})
    assert got["sure"] is True and "set batch_shares=[33, 67]" in got["line"], got["line"]
    assert "(sure: each of 5 probes per rank was faster on h1 than any on h0" in got["line"]


def test_an_even_line_says_how_sure_it_is_too() -> None:
    got = speed.examine(_doc([A, A]), {"h0": 1, "h1": 1})
    assert got["line"].startswith("ranks even in speed: shares by speed [50, 50]"), got["line"]
    assert got["line"].endswith(
        "5 probes per rank overlap (GFLOP/s per rank: h1 70.2-88.1, h0 70.2-88.1))"
    )


def test_one_probe_per_host_says_its_spread_is_unknown() -> None:
    got = speed.examine(_doc([[73.5], [86.9]]), {"h0": 1, "h1": 1})
    assert got["sure"] is None
    assert got["line"].endswith("(unsure: one probe per host, its spread not measured)")


def test_probes_of_one_host_s_ranks_add_up_probe_by_probe() -> None:
    assert speed.host_samples(["a", "a", "b"], [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0, 7.0]]) == {
        "a": [4.0, 6.0],
        "b": [5.0, 6.0],
    }
    # Two ranks planned on h0, one on h1: compared per rank, h0's halves are slower for sure.
    got = speed.examine(_doc([A, B]), {"h0": 2, "h1": 1})
    assert got["sure"] is True and "set batch_shares" in got["line"], got["line"]


def test_the_probe_takes_several_short_samples() -> None:
    assert probe.COMPUTE_PROBES >= speed.MIN_PROBES
    assert probe.compute_gflops(0.02) > 0
