"""The doctor's step-time model and its advice, on synthetic hosts (pure, no processes)."""

from __future__ import annotations

import math

import pytest

from ringtrain.doctor import advice
from ringtrain.doctor.advice import Choice, Fabric, Workload, predict, recommend
from ringtrain.errors import ConfigError

MiB = 1024 * 1024
GBIT = 1e9 / 8  # bytes/s
MBIT = 1e6 / 8


def _fabric(per_host=(1, 1, 1), link=GBIT, **kw) -> Fabric:
    return Fabric(ranks_per_host=tuple(per_host), link_bytes_per_s=link, **kw)


def test_ring_allreduce_time_follows_the_textbook_formula() -> None:
    n, nbytes, bw, lat = 4, 100 * MiB, GBIT, 50e-6
    expected = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    assert advice.ring_allreduce_s(nbytes, n, bw, lat) == pytest.approx(expected)
    assert advice.ring_allreduce_s(nbytes, 1, bw, lat) == 0.0


def test_one_rank_communicates_nothing() -> None:
    p = predict(Workload(100 * MiB, 0.1), _fabric((1,)))
    assert p.comm_s == 0 and p.efficiency == 1.0 and p.speedup == 1.0


def test_fp16_halves_the_bandwidth_term() -> None:
    fabric = _fabric(link_latency_s=0.0, op_overhead_s=0.0)
    work = Workload(64 * MiB, 0.5)
    none = advice.comm_seconds(work, fabric, Choice("none"))
    fp16 = advice.comm_seconds(work, fabric, Choice("fp16"))
    assert fp16 == pytest.approx(none / 2)


def test_slower_links_predict_lower_efficiency() -> None:
    work = Workload(100 * MiB, 0.2)
    effs = [predict(work, _fabric(link=bw)).efficiency for bw in (10 * GBIT, GBIT, 100 * MBIT)]
    assert effs == sorted(effs, reverse=True)
    assert effs[0] > effs[-1]


def test_overlap_hides_communication_up_to_the_backward_pass() -> None:
    work = Workload(10 * MiB, 1.0, backward_fraction=0.5, overlap=0.8)
    p = predict(work, _fabric(link=GBIT))
    # Short communication: only the part that cannot overlap is exposed.
    assert p.exposed_s == pytest.approx(0.2 * p.comm_s)
    assert p.step_s == pytest.approx(1.0 + p.exposed_s)


def test_accumulation_divides_the_exposed_time() -> None:
    work = Workload(200 * MiB, 0.05)
    fabric = _fabric(link=100 * MBIT)
    one = predict(work, fabric, Choice(backward_passes_per_step=1))
    four = predict(work, fabric, Choice(backward_passes_per_step=4))
    assert four.exposed_s == pytest.approx(one.exposed_s / 4)
    assert four.efficiency > one.efficiency


def test_a_fast_network_needs_no_change() -> None:
    a = recommend(Workload(4 * MiB, 0.5), _fabric(link=10 * GBIT))
    assert a.recommended.choice == Choice()
    assert a.recommended.efficiency >= a.target
    assert any("no change needed" in r for r in a.reasons)


def test_a_slow_network_gets_compression_first() -> None:
    work = Workload(100 * MiB, 0.5)
    fabric = _fabric(link=GBIT)
    a = recommend(work, fabric, target=0.9)
    assert a.baseline.efficiency < 0.9
    c = a.recommended.choice
    assert c.compression != "none" and c.backward_passes_per_step == 1
    assert a.recommended.efficiency >= 0.9
    # The least intrusive choice that reaches the target: nothing earlier in the order does.
    order = advice.COMPRESSION_ORDER
    for earlier in order[: order.index(c.compression)]:
        assert predict(work, fabric, Choice(earlier)).efficiency < 0.9


def test_accumulation_is_advised_when_compression_is_not_enough() -> None:
    work = Workload(100 * MiB, 0.05)
    fabric = _fabric(link=100 * MBIT)
    a = recommend(work, fabric, target=0.9)
    assert all(p.efficiency < 0.9 for p in a.by_compression)
    assert a.recommended.choice.backward_passes_per_step > 1
    assert any("backward_passes_per_step" in r and "learning rate" in r for r in a.reasons)


def test_a_hopeless_network_says_so_and_gives_the_best_setting() -> None:
    work = Workload(400 * MiB, 0.01)
    fabric = _fabric(link=10 * MBIT)
    a = recommend(work, fabric, target=0.9)
    assert a.recommended.efficiency < 0.9
    best = max(
        predict(work, fabric, Choice(c, k)).efficiency
        for c in advice.COMPRESSION_ORDER
        for k in advice.ACCUMULATION_CHOICES
    )
    assert a.recommended.efficiency == pytest.approx(best)
    assert any("no setting reaches" in r for r in a.reasons)


def test_hierarchical_is_advised_for_several_ranks_per_host_on_high_latency() -> None:
    work = Workload(1 * MiB, 0.02)
    fabric = _fabric((8, 8), link=GBIT, link_latency_s=1e-3, local_bytes_per_s=20 * GBIT)
    a = recommend(work, fabric)
    assert a.recommended.choice.hierarchical
    flat = predict(work, fabric, Choice(hierarchical=False))
    hier = predict(work, fabric, Choice(hierarchical=True))
    assert hier.comm_s < flat.comm_s


def test_hierarchical_is_not_advised_with_one_rank_per_host() -> None:
    a = recommend(Workload(100 * MiB, 0.1), _fabric((1, 1, 1), link=GBIT))
    assert not a.recommended.choice.hierarchical


def test_topk_traffic_grows_with_the_world_size() -> None:
    work = Workload(100 * MiB, 0.1)
    small = advice.comm_seconds(work, _fabric((1,) * 2, op_overhead_s=0), Choice("topk"))
    large = advice.comm_seconds(work, _fabric((1,) * 32, op_overhead_s=0), Choice("topk"))
    assert large > 10 * small


def test_measured_bus_bandwidth_replaces_the_link_figure() -> None:
    work = Workload(64 * MiB, 0.1, overlap=0.0)
    measured = _fabric(
        (1, 1), link=10 * GBIT, measured_busbw=GBIT, op_overhead_s=0, link_latency_s=0
    )
    p = predict(work, measured)
    assert p.comm_s == pytest.approx(2 * (2 - 1) / 2 * 64 * MiB / GBIT)


def test_bucket_count_multiplies_the_fixed_cost() -> None:
    fabric = _fabric((1, 1), link=1e15, link_latency_s=0.0, op_overhead_s=1e-3)
    work = Workload(100 * MiB, 1.0, bucket_bytes=25 * MiB)
    assert advice.comm_seconds(work, fabric, Choice()) == pytest.approx(
        math.ceil(100 / 25) * 1e-3, rel=1e-3
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grad_bytes": 0, "step_time_s": 0.1}, "model size"),
        ({"grad_bytes": 10, "step_time_s": 0}, "step time"),
        ({"grad_bytes": 10, "step_time_s": 0.1, "overlap": 2.0}, "fractions"),
    ],
)
def test_bad_workloads_are_config_errors(kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        Workload(**kwargs)


def test_unknown_compression_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown compression"):
        predict(Workload(10, 0.1), _fabric(), Choice("zip"))
