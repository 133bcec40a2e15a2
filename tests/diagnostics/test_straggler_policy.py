"""The straggler policy on synthetic timings."""

from __future__ import annotations

import pytest

from ringtrain.diagnostics.straggler import RankTimes, analyse


def _times(compute=(0.2, 0.2, 0.2, 0.2), inputs=(0.01,) * 4, wait=0.02):
    hosts = ["a", "a", "b", "b"]
    return [RankTimes(r, hosts[r], inputs[r], compute[r], wait) for r in range(4)]


def test_balanced() -> None:
    r = analyse(_times())
    assert r.kind == "none" and r.slowest_rank is None
    assert "balanced" in r.line()


def test_compute_bound_rank_is_named() -> None:
    r = analyse(_times(compute=(0.2, 0.2, 0.45, 0.2)))
    assert r.kind == "compute" and r.ranks == (2,) and r.hosts == ("b",)
    assert r.line().startswith("ringtrain straggler report: rank 2 on host b is compute-bound")
    assert "2.2x" in r.line()


def test_input_bound_rank_is_named() -> None:
    r = analyse(_times(inputs=(0.01, 0.3, 0.01, 0.01)))
    assert r.kind == "input" and r.ranks == (1,)


def test_slow_link_blames_every_rank_of_that_host() -> None:
    r = analyse(_times(wait=0.5), link_mb_s={"a": 110.0, "b": 1.2})
    assert r.kind == "network" and r.ranks == (2, 3) and r.hosts == ("b",)
    assert "ranks 2, 3 on host b are network-bound" in r.line()


def test_two_hosts_share_their_one_link_and_are_both_named() -> None:
    r = analyse(_times(wait=0.5), link_mb_s={"a": 1.21, "b": 1.2})
    assert r.kind == "network" and r.ranks == (0, 1, 2, 3) and r.hosts == ("a", "b")


def test_communication_dominated_without_link_numbers() -> None:
    r = analyse(_times(wait=1.0))
    assert r.kind == "network" and r.ranks == (0, 1, 2, 3)


def test_noise_is_not_a_straggler() -> None:
    # 30% slower but only 3 ms of a 0.2 s step: not worth reporting.
    r = analyse(_times(compute=(0.010, 0.010, 0.013, 0.010), wait=0.19))
    assert r.kind != "compute"


def test_empty_input_is_an_error() -> None:
    with pytest.raises(ValueError):
        analyse([])


def test_a_slow_link_explains_a_busier_rank_on_the_same_host() -> None:
    r = analyse(_times(compute=(0.05, 0.05, 0.05, 0.11), wait=0.3), link_mb_s={"a": 105, "b": 1.2})
    assert r.kind == "network" and r.hosts == ("b",)


def test_network_hints_name_the_settings_of_the_jobs_mode() -> None:
    """Gradients every step: compression of the gradients; local updates (their waits are the
    outer exchanges): the outer exchange's settings, never the gradients' compression."""
    slow_link = {"link_mb_s": {"a": 110.0, "b": 1.2}}
    for kw in (slow_link, {}):
        synced = analyse(_times(wait=1.0), **kw).line()
        local = analyse(_times(wait=1.0), **kw, local_updates=True).line()
        assert "--compression" in synced and "outer_compression" not in synced
        assert "outer_compression='int4'" in local and "sync_every" in local
        assert "outer_overlap=True" in local and "--compression" not in local


def test_of_two_ranks_the_slow_one_is_compared_with_the_other() -> None:
    # The median of two ranks is their mean, the slow rank's own time half of it: a rank 10x
    # slower than its peer read "vs median 0.275 s (1.8x)", and the sync_every advice aimed
    # its round at that mean, still far longer than its peer's round.
    times = [RankTimes(0, "a", 0.01, 0.05, 0.3), RankTimes(1, "b", 0.01, 0.5, 0.0)]
    r = analyse(times, in_force=None)
    assert r.kind == "compute" and r.ranks == (1,)
    assert "compute 0.500 s/step vs median 0.050 s (10.0x)" in r.line()
    rounds = [RankTimes(0, "a", 0.0, 0.4, 0.0), RankTimes(1, "b", 0.0, 0.2, 0.2)]
    line = analyse(rounds, in_force=None, per="round").line()
    assert "about 50% of its steps now" in line, line
