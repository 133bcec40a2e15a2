"""The doctor's pure checks: placement, link analysis, host facts, and the report's rendering."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.doctor import checkup, command, findings, gather, placement, report
from ringtrain.doctor.findings import LinkSample
from ringtrain.errors import LaunchError
from ringtrain.host.network import Interface
from ringtrain.launch import job_network
from ringtrain.launch.hosts import Host, parse_hosts

MBIT = 1e6 / 8
GBIT = 1e9 / 8

# ---- placement ---------------------------------------------------------------------------------


def test_4_3_1_is_flagged_with_its_cost_and_a_fix() -> None:
    r = placement.check(8, parse_hosts("a:4,b:3,c:1"))
    assert r.ranks_per_host == {"a": 4, "b": 3, "c": 1} and r.pattern() == "4-3-1"
    assert r.uneven and r.imbalance == 4
    # Equal hosts: the lock-step pace is a rank with a quarter host; 8 such ranks use 2 of 3.
    assert r.compute_efficiency == pytest.approx(8 * (1 / 4) / 3)
    assert r.cross_traffic_per_rank["c"] == pytest.approx(4 * r.cross_traffic_per_rank["a"])
    (msg,) = r.warnings
    assert "uneven placement 4-3-1" in msg and "67%" in msg
    assert "-np 3 (1 per host)" in msg and "-H a:3,b:3,c:2" in msg


def test_even_spread_is_suggested_when_the_slots_allow_it() -> None:
    r = placement.check(8, parse_hosts("a:4,b:4,c:4"))
    assert r.ranks_per_host == {"a": 4, "b": 4}
    assert not r.uneven
    assert any("leaves c without ranks" in w and "-H a:3,b:3,c:2" in w for w in r.warnings)


def test_uneven_placement_offers_the_even_alternative() -> None:
    r = placement.check(6, parse_hosts("a:4,b:4,c:4"))  # fills a:4, b:2 -> 4-2
    assert r.uneven and r.even_alternative == {"a": 2, "b": 2, "c": 2}
    assert r.even_efficiency == pytest.approx(1.0)
    assert r.even_efficiency > r.compute_efficiency


def test_even_placement_is_not_flagged() -> None:
    r = placement.check(6, parse_hosts("a:2,b:2,c:2"))
    assert not r.uneven and r.warnings == [] and r.compute_efficiency == pytest.approx(1.0)


def test_cores_in_proportion_to_ranks_cost_no_compute() -> None:
    r = placement.check(8, parse_hosts("a:4,b:3,c:1"), cores={"a": 8, "b": 6, "c": 2})
    assert r.uneven and r.compute_efficiency == pytest.approx(1.0)


def test_more_ranks_than_cores_is_a_warning() -> None:
    r = placement.check(4, parse_hosts("a:4"), cores={"a": 2})
    assert any("4 ranks on 2 cores" in w for w in r.warnings)


def test_too_many_ranks_for_the_slots_is_the_launchers_error() -> None:
    with pytest.raises(LaunchError, match="-np 9 needs 9 slots"):
        placement.check(9, parse_hosts("a:4,b:4"))


def test_even_placement_respects_slots_and_host_order() -> None:
    assert placement.even_placement(7, parse_hosts("a:1,b:4,c:4")) == {"a": 1, "b": 3, "c": 3}
    assert placement.even_placement(2, parse_hosts("a:2,b:2,c:2")) == {"a": 1, "b": 1}


# ---- links -------------------------------------------------------------------------------------


def _matrix(rates: dict[tuple[str, str], float], rtt: float = 1e-4) -> list[LinkSample]:
    return [LinkSample(s, d, bw, rtt) for (s, d), bw in rates.items()]


def _full(hosts: list[str], rate, rtt: float = 1e-4) -> list[LinkSample]:
    return _matrix({(s, d): rate(s, d) for s in hosts for d in hosts if s != d}, rtt)


def test_one_slow_host_is_named_although_most_pairs_are_slow() -> None:
    # h0 at 10 Mbit/s: 4 of the 6 pairs are slow, so the median pair is slow too.
    samples = _full(["h0", "h1", "h2"], lambda s, d: 9 * MBIT if "h0" in (s, d) else 900 * MBIT)
    a = findings.analyze_links(samples)
    assert a.slow_hosts == ["h0"]
    assert sorted(a.slow_pairs) == sorted([("h0", "h1"), ("h0", "h2"), ("h1", "h0"), ("h2", "h0")])
    assert a.slowest == pytest.approx(9 * MBIT)
    (warning,) = a.warnings
    assert warning.startswith("host h0's link is slow") and "h1->h0" in warning
    assert a.problems == []


def test_a_slow_path_between_fast_hosts_is_named_as_a_pair() -> None:
    slow = {("h1", "h2"), ("h2", "h1")}
    samples = _full(["h0", "h1", "h2", "h3"], lambda s, d: 50 * MBIT if (s, d) in slow else GBIT)
    a = findings.analyze_links(samples)
    assert a.slow_hosts == []
    assert sorted(a.slow_pairs) == sorted(slow)
    assert any("the link from h1 to h2 is slow" in w for w in a.warnings)


def test_equal_links_raise_nothing() -> None:
    a = findings.analyze_links(_full(["a", "b"], lambda s, d: GBIT))
    assert a.slow_hosts == [] and a.slow_pairs == [] and a.warnings == [] and a.problems == []


def test_high_latency_pair_is_a_warning() -> None:
    samples = _full(["a", "b", "c"], lambda s, d: GBIT)
    samples[0] = LinkSample(samples[0].src, samples[0].dst, GBIT, 20e-3)
    a = findings.analyze_links(samples)
    assert a.high_latency == [(samples[0].src, samples[0].dst)]


def test_a_failed_link_test_is_a_problem_naming_the_pair() -> None:
    a = findings.analyze_links([LinkSample("a", "b", error="10.0.0.2:5000: Connection refused")])
    (problem,) = a.problems
    assert "from a to b failed" in problem and "Connection refused" in problem


def test_a_retest_replaces_a_figure_only_when_it_is_better() -> None:
    first = [LinkSample("a", "b", GBIT / 10, 1e-4), LinkSample("b", "a", GBIT / 10, 1e-4)]
    kept = gather.keep_better(
        first,
        [
            LinkSample("a", "b", GBIT, 1e-4),  # better: replaces
            LinkSample("b", "a", GBIT / 20, 1e-4),  # worse: the first figure stays
        ],
    )
    assert kept == [LinkSample("a", "b", GBIT, 1e-4), first[1]]
    failed = gather.keep_better(first, [LinkSample("a", "b", error="timed out")])
    assert failed == first


def test_a_slow_pair_is_judged_beside_its_hosts_links_measured_with_it() -> None:
    # h0 shaped; h1 <-> h2 CPU-bound: h1 -> h2 measured on a quiet machine, h2 -> h1 while a
    # load held the cores, so h2 -> h1 reads below half of h1 -> h2 and looks slow.
    rates = {(s, d): 9 * MBIT for s in ["h0", "h1", "h2"] for d in ["h0", "h1", "h2"] if s != d}
    rates |= {("h1", "h2"): 3000 * MBIT, ("h2", "h1"): 1200 * MBIT}
    samples = _matrix(rates)
    assert ("h2", "h1") in findings.analyze_links(samples).slow_pairs
    # Its round: the pair, then the links that give its hosts their capacity (here its reverse).
    assert findings.reference_pairs(samples, ("h2", "h1")) == [("h1", "h2")]
    under_load = _matrix({("h2", "h1"): 1100 * MBIT, ("h1", "h2"): 1300 * MBIT})
    assert not findings.slow_beside(("h2", "h1"), under_load)
    a = findings.analyze_links(samples, cleared={("h2", "h1")})
    assert a.cleared_pairs == [("h2", "h1")] and ("h2", "h1") not in a.slow_pairs
    assert a.slow_hosts == ["h0"] and len(a.slow_pairs) == 4
    assert not any("the link from h2 to h1" in w for w in a.warnings)


def test_a_slow_path_stays_slow_beside_its_hosts_links() -> None:
    slow = {("h1", "h2"), ("h2", "h1")}
    samples = _full(["h0", "h1", "h2", "h3"], lambda s, d: 50 * MBIT if (s, d) in slow else GBIT)
    refs = findings.reference_pairs(samples, ("h1", "h2"))
    assert len(refs) == 2 and all(set(p) & {"h1", "h2"} and set(p) & {"h0", "h3"} for p in refs)
    again = _matrix({("h1", "h2"): 55 * MBIT, **{p: 0.9 * GBIT for p in refs}})
    assert findings.slow_beside(("h1", "h2"), again)
    # A round that measured nothing else, or failed, cannot clear it.
    assert findings.slow_beside(("h1", "h2"), again[:1])
    assert findings.slow_beside(("h1", "h2"), [LinkSample("h1", "h2", error="timed out")])


def test_docker0_on_every_host_is_not_a_routed_subnet() -> None:
    def host(addr: str, name: str = "eth0") -> list[Interface]:
        return [
            Interface("lo", "127.0.0.1", 8, True, True),
            Interface(name, addr, 24),
            Interface("docker0", "172.17.0.1", 16, flags=("bridge", "docker")),
            Interface("eth1", "", 0, is_up=False),
        ]

    routable, unrouted = checkup.common_subnets(
        {"a": host("10.0.0.1"), "b": host("10.0.0.2", "eth7"), "c": host("10.0.0.3")}
    )
    assert routable == ["10.0.0.0/24"]
    assert unrouted == ["172.17.0.0/16 (a, b, c all have 172.17.0.1)"]


def test_fabric_from_measurements() -> None:
    links = {"slowest_bytes_per_s": 9 * MBIT, "median_rtt_s": 2e-4, "reference_bytes_per_s": GBIT}
    ar = {
        "world": 3,
        "allreduce": [
            {"bytes": 65536, "seconds": 0.08, "busbw": 1.1e6},
            {"bytes": 1 << 20, "seconds": 1.3, "busbw": 1.08e6},
        ],
    }
    f = checkup.fabric_from({"a": 4, "b": 3, "c": 1}, links, ar)
    assert f is not None
    assert f.ranks_per_host == (4, 3, 1) and f.link_bytes_per_s == 9 * MBIT
    assert f.link_latency_s == pytest.approx(1e-4) and f.measured_busbw == 1.1e6
    assert f.local_bytes_per_s == GBIT
    wire_s = 2 * 2 / 3 * 65536 / 1.1e6
    assert f.op_overhead_s == pytest.approx(0.08 - wire_s)
    assert checkup.fabric_from({"a": 1}, None, {"skipped": "--no-allreduce"}) is None


# ---- host facts --------------------------------------------------------------------------------


def _host(name: str, torch: dict | None = None, **facts) -> dict:
    t = {"version": "2.13.0", "distributed": True, "gloo": True, "num_threads": 2}
    return {
        "name": name,
        "reachable": True,
        "error": None,
        "facts": {
            "ringtrain": "0.1.0",
            "python": "3.11.7",
            "cpu": {"usable": 2},
            "torch": t if torch is None else torch,
            **facts,
        },
    }


def test_healthy_hosts_have_no_problems() -> None:
    assert findings.check_hosts([_host("a"), _host("b")]) == ([], [])


def test_torch_missing_is_a_problem() -> None:
    problems, _ = findings.check_hosts(
        [_host("a"), _host("b", {"error": "ModuleNotFoundError: No module named 'torch'"})]
    )
    assert len(problems) == 1 and "torch cannot be imported on host b" in problems[0]


def test_hosts_whose_torch_picks_other_cpu_kernels_are_told_how_to_match() -> None:
    t = {"version": "2.13.0", "distributed": True, "gloo": True, "num_threads": 2}
    wide, plain = ({**t, "cpu_capability": c} for c in ("AVX512", "AVX2"))
    hosts = [_host("a", wide), _host("b", plain)]
    assert findings.check_hosts(hosts) == ([], [])  # no environment given: not judged
    (said,) = findings.check_kernels(hosts, {})
    assert findings.check_hosts(hosts, {}) == ([], [said])
    assert "different CPU kernels: a AVX512, b AVX2" in said
    assert "HINT: ATEN_CPU_CAPABILITY=avx2 ringtrain run ..." in said
    # Set where the doctor (the launcher) runs, ringtrain run gives it to every host.
    assert findings.check_kernels(hosts, {"ATEN_CPU_CAPABILITY": "avx2"}) == []
    assert findings.check_kernels([_host("a", wide), _host("b", wide)], {}) == []
    assert findings.check_kernels([_host("a"), _host("b", plain)], {}) == []  # one host unknown


def test_torch_version_mismatch_is_a_problem() -> None:
    other = {"version": "2.4.0", "distributed": True, "gloo": True}
    problems, _ = findings.check_hosts([_host("a"), _host("b", other)])
    assert len(problems) == 1
    assert "torch versions differ" in problems[0] and "a 2.13.0, b 2.4.0" in problems[0]


def test_unreachable_host_error_is_passed_on() -> None:
    down = {"name": "x", "reachable": False, "error": "host x is unreachable: ...", "facts": None}
    problems, _ = findings.check_hosts([_host("a"), down])
    assert problems == ["host x is unreachable: ..."]


def test_more_threads_than_cores_is_a_warning() -> None:
    busy = {"version": "2.13.0", "distributed": True, "gloo": True, "num_threads": 16}
    _, warnings = findings.check_hosts([_host("a", busy)])
    assert len(warnings) == 1 and "16 threads" in warnings[0]


# ---- report ------------------------------------------------------------------------------------


def test_report_renders_every_section() -> None:
    samples = _full(["h0", "h1"], lambda s, d: GBIT)
    links = {
        "skipped": None,
        "pairs": [
            {
                "src": s.src,
                "dst": s.dst,
                "bytes_per_s": s.bytes_per_s,
                "rtt_s": s.rtt_s,
                "error": None,
            }
            for s in samples
        ],
        **findings.analyze_links(samples).to_dict(),
    }
    place = placement.check(3, parse_hosts("h0:2,h1:1"))
    doc = {
        "hosts": [_host("h0"), _host("h1")],
        "network": {
            "routable_subnets": ["10.0.0.0/24"],
            "unrouted_subnets": ["172.17.0.0/16 (h0, h1 all have 172.17.0.1)"],
            "chosen": {
                "h0": {"name": "eth0", "address": "10.0.0.1"},
                "h1": {"name": "eth0", "address": "10.0.0.2"},
            },
        },
        "links": links,
        "allreduce": {
            "world": 2,
            "hosts": ["h0", "h1"],
            "allreduce": [{"bytes": 65536, "seconds": 0.001, "busbw": 6.5e7}],
        },
        "placement": place.to_dict(),
        "prediction": None,
        "problems": [],
        "warnings": place.warnings,
        "ok": True,
        "seconds": 1.0,
    }
    text = report.render(doc)
    for needle in (
        "not routed: 172.17.0.0/16",
        "Hosts",
        "h0",
        "2.13.0",
        "Links",
        "1,000 Mbit/s",
        "64 KiB",
        "UNEVEN",
        "verdict: OK",
    ):
        assert needle in text


# ---- the launcher's own checks -----------------------------------------------------------------


def _probe(name: str, *ifaces: Interface) -> gather.HostProbe:
    return gather.HostProbe(name, True, facts={"interfaces": [i.to_dict() for i in ifaces]})


@pytest.mark.parametrize("hosts", [("localhost",), ("a", "b")])
def test_an_interface_ringtrain_run_refuses_is_a_problem(hosts: tuple[str, ...]) -> None:
    """The doctor asks the launcher's own check (job_network), on one host as on several."""
    ifaces = [Interface("lo", "127.0.0.1", 8, True, True), Interface("eth0", "10.0.0.1", 24)]
    probes = [_probe(h, *ifaces) for h in hosts]
    per_host = {h: ifaces for h in hosts}
    with pytest.raises(LaunchError) as refused:
        job_network.check_interface_on("eth9", per_host, {})
    section, chosen, problem = checkup._network(probes, "eth9")
    assert chosen is None and problem is not None
    assert str(refused.value).splitlines()[0] in problem  # ringtrain run's words
    assert "has no interface named 'eth9'" in problem and section["error"]
    _, _, fine = checkup._network(probes, "eth0")
    assert fine is None


def test_a_refused_interface_is_not_shown_as_no_common_subnet() -> None:
    # The hosts share 10.0.0.0/24; only the name given is wrong. The report said "NO COMMON
    # SUBNET", which sent the user to the network rather than to the flag.
    probes = [
        _probe("a", Interface("eth0", "10.0.0.1", 24)),
        _probe("b", Interface("eth0", "10.0.0.2", 24)),
    ]
    section, _, problem = checkup._network(probes, "eth9")
    assert problem is not None
    lines = "\n".join(report._network({"network": section}))
    assert "NO COMMON SUBNET" not in lines, lines
    assert "10.0.0.0/24" in lines and "--network-interface 'eth9' REFUSED" in lines, lines
    # A network that connects nothing is still said so.
    apart = [
        _probe("a", Interface("eth0", "10.0.0.1", 24)),
        _probe("b", Interface("eth0", "10.1.0.2", 24)),
    ]
    section, _, problem = checkup._network(apart, "")
    assert problem is not None
    assert "NO COMMON SUBNET" in "\n".join(report._network({"network": section}))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--link-seconds", "nan"], "--link-seconds must be > 0"),
        (["--allreduce-budget", "-1"], "--allreduce-budget must be > 0"),
        (["--start-timeout", "inf"], "--start-timeout must be > 0"),
        (["--model-params", "nan", "--step-time", "1"], "--model-params must be > 0"),
        (["--model-mb", "inf", "--step-time", "1"], "--model-mb must be > 0"),
        (["--model-mb", "10", "--step-time", "nan"], "--step-time must be > 0"),
        (["--target-efficiency", "5"], "--target-efficiency must be > 0 and <= 1"),
        (["--fusion-threshold-mb", "nan"], "--fusion-threshold-mb must be >= 0"),
        (["-np", "0"], "-np must be >= 1"),
        (["-H", ""], "-H '' lists no hosts"),  # not read as "this host"
        (["--ssh-connect-timeout", "-1"], "--ssh-connect-timeout must be >= 1"),
    ],
)
@pytest.mark.timeout(60)
def test_bad_numbers_are_one_error_before_any_host_is_probed(
    capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    assert cli.main(["doctor", *flags]) == 2
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("ringtrain doctor: error:")]
    assert says in line, err
    assert "HINT:" in err and "Traceback" not in err and "probing" not in err


@pytest.mark.timeout(60)
def test_an_ssh_file_that_cannot_be_read_is_refused_before_any_host_is_probed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `run` refuses it (docs/launch.md): ssh would read it on this host for every other."""

    def probed(*_: object) -> None:
        raise AssertionError("doctor probed hosts with an ssh file it cannot read")

    monkeypatch.setattr(checkup, "examine", probed)
    missing = tmp_path / "id_missing"
    assert cli.main(["doctor", "-H", "node1:1,node2:1", "--ssh-identity-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--ssh-identity-file {str(missing)!r}: {missing} does not exist." in err, err
    assert "HINT:" in err and "Traceback" not in err


class _FakeReceiver:
    def __init__(self, host: Host, address: str, *_: object) -> None:
        self.host, self.address, self.port, self.error = host, address, 1, None

    def wait_ready(self, timeout_s: float) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_retests_clear_a_pair_that_a_load_slowed_and_keep_a_slow_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # h0 is shaped to 9 Mbit/s; h1 <-> h2 is CPU-bound: h1 -> h2 measured on a quiet machine,
    # then a load halves everything measured after it, h2 -> h1 included, in every retest.
    sent: list[tuple[str, str]] = []

    def send(src: Host, targets: list[_FakeReceiver], *_: object) -> list[LinkSample]:
        out = []
        for t in targets:
            pair = (src.name, t.host.name)
            quiet = not sent  # only the very first measurement ran without the load
            sent.append(pair)
            rate = 9 * MBIT if "h0" in pair else (3000 if quiet else 1200) * MBIT
            out.append(LinkSample(*pair, rate, 1e-4))
        return out

    monkeypatch.setattr(gather, "_Receiver", _FakeReceiver)
    monkeypatch.setattr(gather, "_send", send)
    hosts = [Host("h1", 1), Host("h2", 1), Host("h0", 1)]
    nic = {h.name: Interface("eth0", f"10.0.0.{i}", 24) for i, h in enumerate(hosts)}
    samples, cleared = gather.measure_links(hosts, nic, gather.Reach(), 0.5)
    a = findings.analyze_links(samples, cleared=cleared)
    # h2 -> h1 (1200 against h1 -> h2's 3000) was retested beside h1 -> h2, and cleared.
    assert cleared == {("h2", "h1")} and a.cleared_pairs == [("h2", "h1")]
    assert a.slow_hosts == ["h0"] and all("h0" in p for p in a.slow_pairs)
    assert len(a.slow_pairs) == 4
    # h0's pairs: measured, then retested once; the cleared pair's round ran back to back.
    assert sum("h0" in p for p in sent) == 8
    assert sent[-2:] == [("h2", "h1"), ("h1", "h2")]


@pytest.mark.parametrize(
    ("flags", "np"), [((), None), (("-np", "4"), 4), (("-H", "localhost:3"), 3)]
)
def test_a_placement_is_checked_only_where_a_job_size_is_known(
    flags: tuple[str, ...], np: int | None
) -> None:
    """Plain ``ringtrain doctor`` knows no job: its placement section said "Placement of -np 1"
    beside a 2-rank allreduce job. It now says it checked none and how to ask for one."""
    parser = argparse.ArgumentParser()
    command.configure(parser)
    options = command.options_from_args(parser.parse_args(list(flags)))
    section, counts, problems, _ = checkup._placement(options, [])
    assert section["np"] == np and not problems and counts
    text = "\n".join(report._placement({"placement": section, "hosts": []}))
    if np is None:
        assert text == (
            "Placement: not checked (this machine and no -np; give -np N, and -H or "
            "--hostfile for more hosts)"
        ), text
    else:
        assert text.startswith(f"Placement of -np {np}: {np} (localhost {np}) even"), text
