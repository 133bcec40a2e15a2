"""Issue 28: a link too slow for data-parallel training is a warning even without a model; a
model predicted under 50% efficiency makes the verdict not OK; the advice offers local updates
and says what each setting does to the batch (pure: synthetic links)."""

from __future__ import annotations

from ringtrain.doctor import advice, checkup, findings
from ringtrain.doctor.advice import Fabric, Workload, recommend
from ringtrain.doctor.findings import LinkSample

MBIT = 1e6 / 8


def _pair(rate: float) -> list[LinkSample]:
    return [LinkSample("h0", "h1", rate, 1e-4), LinkSample("h1", "h0", rate, 1e-4)]


def test_ten_mbit_link_is_a_warning_naming_it_and_its_capacity() -> None:
    a = findings.analyze_links(_pair(9.6 * MBIT))
    slow = [w for w in a.warnings if "too slow for useful data-parallel" in w]
    assert len(slow) == 1 and a.problems == []
    assert "from h0 to h1" in slow[0] or "from h1 to h0" in slow[0]
    carried = findings.carried_grad_bytes(9.6 * MBIT)
    # 80% efficiency on a 1 s step leaves 0.25 s: 0.3 MB over 1.2 MB/s.
    assert abs(carried - 0.25 * 9.6 * MBIT) < 1
    assert f"{carried / 2**20:.2g} MiB" in slow[0]
    assert "sync_every" in slow[0]


def test_gigabit_link_is_not_a_slow_training_link() -> None:
    a = findings.analyze_links(_pair(940 * MBIT))
    assert not [w for w in a.warnings if "too slow" in w]


def _issue_example(link_mbit: float) -> advice.Advice:
    """The issue's figures: 25M parameters, 0.8 s per step, 2 hosts with one rank each."""
    work = Workload(4 * 25_000_000, 0.8)
    return recommend(work, Fabric((1, 1), link_mbit * MBIT))


def test_advice_offers_local_updates_with_their_batch() -> None:
    adv = _issue_example(9.6)
    assert adv.best_synchronous < advice.USEFUL_EFFICIENCY
    text = "\n".join(adv.reasons)
    assert "local updates: sync_every=" in text and "batch stays" in text
    assert "outer optimizer" in text
    effs = [p.efficiency for p in adv.local_updates]
    assert effs == sorted(effs)  # rarer exchanges, higher efficiency
    assert [p.sync_every for p in adv.local_updates] == list(advice.SYNC_EVERY_CHOICES)
    assert "local_updates" in adv.to_dict()


def test_prediction_under_half_is_a_problem_and_above_is_not() -> None:
    slow = _issue_example(9.6).to_dict() | {"world": 2}
    (problem,) = checkup._too_slow(slow)
    assert "under 50%" in problem and "HINT" in problem and "sync_every=" in problem
    fast = _issue_example(10_000).to_dict() | {"world": 2}
    assert checkup._too_slow(fast) == []
