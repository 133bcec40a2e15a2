"""The doctor's sequence: probe hosts, pick the network, test links, allreduce, placement, advice.

:func:`examine` returns one plain dict (the ``--json`` output, rendered as tables by
:mod:`ringtrain.doctor.report`). Later steps run only when the earlier ones leave
something to test: links need two reachable hosts on a common subnet, the allreduce job needs
every host healthy. Problems make the exit code 1, warnings do not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ringtrain import environ
from ringtrain.doctor import advice, findings, gather, placement, speed
from ringtrain.doctor.gather import Reach
from ringtrain.errors import LaunchError
from ringtrain.host import network
from ringtrain.host.network import Interface
from ringtrain.launch import job_network
from ringtrain.launch.hosts import Host

KiB, MiB = 1024, 1024 * 1024
DEFAULT_SIZES = (64 * KiB, 1 * MiB, 8 * MiB)
REPORT_VERSION = 1


@dataclass(frozen=True)
class DoctorOptions:
    hosts: tuple[Host, ...]
    np: int | None = None
    # False where no -H or --hostfile named the hosts (this machine, one slot): with no -np
    # either, no job's placement is known, and none is checked.
    hosts_given: bool = True
    reach: Reach = field(default_factory=Reach)
    network_interface: str = ""
    links: bool = True
    link_seconds: float = 1.0
    allreduce: bool = True
    sizes: tuple[int, ...] = DEFAULT_SIZES
    allreduce_budget_s: float = 6.0
    start_timeout_s: float = 60.0
    probe_timeout_s: float = 120.0
    # Prediction inputs: both or neither.
    grad_bytes: int | None = None
    step_time_s: float | None = None
    target_efficiency: float = advice.DEFAULT_TARGET
    bucket_bytes: int = 64 * MiB


def _usable(ifaces: Sequence[Interface]) -> list[Interface]:
    return [i for i in ifaces if i.address and i.is_up and not i.is_loopback]


def common_subnets(per_host: Mapping[str, Sequence[Interface]]) -> tuple[list[str], list[str]]:
    """Subnets where every host has an up, non-loopback address: (routable, not routed).

    A subnet where two hosts have the same address is host-local on each (every host's
    ``docker0`` is 172.17.0.1/16), so it is not routed between them, as
    :func:`ringtrain.host.network.choose` also judges.
    """
    usable = {h: _usable(ifaces) for h, ifaces in per_host.items()}
    nets = [{i.network for i in ifaces} for ifaces in usable.values()]
    if not nets:
        return [], []
    routable, unrouted = [], []
    for net in sorted(set.intersection(*nets), key=lambda n: (n.network_address, n.prefixlen)):
        owners: dict[str, list[str]] = {}
        for h, ifaces in usable.items():
            for i in ifaces:
                if i.network == net:
                    owners.setdefault(i.address, []).append(h)
        shared = [f"{', '.join(hs)} all have {a}" for a, hs in owners.items() if len(hs) > 1]
        if shared:
            unrouted.append(f"{net} ({'; '.join(shared)})")
        else:
            routable.append(str(net))
    return routable, unrouted


def _network(
    probes: Sequence[gather.HostProbe], spec: str
) -> tuple[dict[str, Any], dict[str, Interface] | None, str | None]:
    """The network section, the chosen interface per host, and a problem if there is none."""
    per_host = {
        p.name: [Interface.from_dict(i) for i in (p.facts or {}).get("interfaces", [])]
        for p in probes
        if p.facts is not None
    }
    routable, unrouted = common_subnets(per_host)
    section: dict[str, Any] = {"routable_subnets": routable, "unrouted_subnets": unrouted}
    section["chosen"] = None
    if spec.strip():
        # ringtrain run's own check, whatever the host count: what it refuses, this reports.
        # Hosts that did not answer are taken on trust (they are a problem of their own).
        try:
            job_network.check_interface_on(
                spec, {p.name: per_host.get(p.name, []) for p in probes}, {}
            )
        except LaunchError as e:
            section["error"], section["refused_interface"] = str(e), spec
            return section, None, f"ringtrain run would refuse the network interface: {e}"
    if len(probes) < 2:
        section["note"] = "one host: its ranks talk over loopback"
        return section, None, None
    if len(per_host) < 2:
        section["note"] = "fewer than two hosts answered; nothing to connect"
        return section, None, None
    try:
        chosen = network.resolve_spec(spec, per_host) if spec.strip() else network.choose(per_host)
    except LaunchError as e:
        section["error"] = str(e)
        return section, None, f"no network connects all hosts: {e}"
    section["chosen"] = {h: i.to_dict() for h, i in chosen.items()}
    return section, chosen, None


def _links(
    options: DoctorOptions, hosts: Sequence[Host], chosen: Mapping[str, Interface]
) -> dict[str, Any]:
    samples, cleared = gather.measure_links(hosts, chosen, options.reach, options.link_seconds)
    analysis = findings.analyze_links(samples, cleared=cleared)
    return {
        "pairs": [
            {
                "src": s.src,
                "dst": s.dst,
                "bytes_per_s": s.bytes_per_s,
                "mbit_s": None if s.bytes_per_s is None else s.bytes_per_s * 8 / 1e6,
                "rtt_s": s.rtt_s,
                "error": s.error,
            }
            for s in samples
        ],
        **analysis.to_dict(),
        "_analysis": analysis,
    }


def fabric_from(
    counts: Mapping[str, int], links: Mapping[str, Any] | None, allreduce: Mapping[str, Any] | None
) -> advice.Fabric | None:
    """The prediction's view of the hosts, from the links and allreduce sections (pure).

    Bandwidth: the slowest measured link (else the allreduce bus bandwidth); latency: half the
    median round trip; the fixed cost per collective: the smallest allreduce's time less its
    bytes at the largest size's bus bandwidth. None when nothing was measured.
    """
    points = list((allreduce or {}).get("allreduce") or [])
    measured = max((p["busbw"] for p in points), default=0.0) or None
    link = (links or {}).get("slowest_bytes_per_s")
    rtt = (links or {}).get("median_rtt_s")
    overhead = 1e-3
    if points and measured:
        small = min(points, key=lambda p: p["bytes"])
        n = int(allreduce.get("world", 2)) if allreduce else 2
        wire_s = 2 * (n - 1) / n * small["bytes"] / measured
        overhead = max(0.0, float(small["seconds"]) - wire_s)
    bandwidth = link or measured
    if not bandwidth:
        return None
    return advice.Fabric(
        ranks_per_host=tuple(counts.values()),
        link_bytes_per_s=float(bandwidth),
        link_latency_s=float(rtt) / 2 if rtt else 100e-6,
        # Within a host: measured on one host; across hosts not measured, so taken as fast as
        # the median host's best link (copies in memory are rarely slower than a NIC).
        local_bytes_per_s=measured
        if len(counts) == 1
        else (links or {}).get("reference_bytes_per_s"),
        op_overhead_s=overhead,
        measured_busbw=measured,
    )


def _run_allreduce(options: DoctorOptions) -> dict[str, Any]:
    t0 = time.monotonic()
    out = gather.allreduce_job(
        options.hosts,
        options.reach,
        options.sizes,
        options.allreduce_budget_s,
        options.start_timeout_s,
        options.network_interface,
    )
    return {"skipped": None, **out, "seconds": round(time.monotonic() - t0, 2)}


def _placement(
    options: DoctorOptions, probes: Sequence[gather.HostProbe]
) -> tuple[dict[str, Any], dict[str, int] | None, list[str], list[str]]:
    """The placement section, ranks per host, problems and warnings."""
    if not options.hosts_given and options.np is None:
        skipped = "this machine and no -np; give -np N, and -H or --hostfile for more hosts"
        return {"np": None, "skipped": skipped}, {h.name: 1 for h in options.hosts}, [], []
    np = options.np or sum(h.slots for h in options.hosts)
    cores = {
        p.name: int((p.facts or {}).get("cpu", {}).get("usable") or 0)
        for p in probes
        if p.facts is not None
    }
    try:
        rep = placement.check(np, options.hosts, {h: c for h, c in cores.items() if c})
    except LaunchError as e:
        return {"np": np, "error": str(e)}, None, [str(e)], []
    # Each rank's sockets and files grow with -np, whatever the placement: the model's figures,
    # and each host's open-file limit against them.
    doc = {**rep.to_dict(), "connections": findings.connections_at(np)}
    warnings = list(rep.warnings)
    for p in probes:
        if p.facts is not None:
            warnings += findings.check_open_files(p.name, p.facts, np)
    return doc, rep.ranks_per_host, [], warnings


def _prediction(
    options: DoctorOptions,
    counts: Mapping[str, int],
    links: Mapping[str, Any],
    allreduce: Mapping[str, Any],
) -> dict[str, Any]:
    assert options.grad_bytes and options.step_time_s
    fabric = fabric_from(counts, links if links.get("pairs") else None, allreduce)
    if fabric is None:
        return {"skipped": "no link or allreduce measurement to predict from"}
    work = advice.Workload(
        options.grad_bytes, options.step_time_s, bucket_bytes=options.bucket_bytes
    )
    adv = advice.recommend(work, fabric, options.target_efficiency)
    return {
        "grad_bytes": options.grad_bytes,
        "step_time_s": options.step_time_s,
        "world": fabric.world,
        "fabric": {
            "link_bytes_per_s": fabric.link_bytes_per_s,
            "link_latency_s": fabric.link_latency_s,
            "measured_busbw": fabric.measured_busbw,
            "op_overhead_s": fabric.op_overhead_s,
        },
        **adv.to_dict(),
    }


def _too_slow(prediction: Mapping[str, Any]) -> list[str]:
    """A problem when no synchronous setting is predicted at USEFUL_EFFICIENCY."""
    best = float(prediction["best_synchronous_efficiency"])
    if best >= advice.USEFUL_EFFICIENCY:
        return []
    local = prediction.get("local_updates") or []
    good = next((p for p in local if p["efficiency"] >= advice.DEFAULT_TARGET), None)
    offer = (
        f"local updates with sync_every={good['sync_every']} are predicted at "
        f"{good['efficiency']:.0%}"
        if good
        else "local updates (sync_every) send the weights once every H steps instead"
    )
    return [
        f"data-parallel training of this model is predicted at {best:.0%} efficiency at best "
        f"(under {advice.USEFUL_EFFICIENCY:.0%}): {prediction['world']} ranks would train little "
        "faster than one, or slower.\nHINT: " + offer + " (DistributedOptimizer(sync_every=H) "
        "or RINGTRAIN_SYNC_EVERY=auto; docs/engine.md); or use fewer, faster-linked hosts."
    ]


def _allreduce_job(
    options: DoctorOptions,
    early: Future[dict[str, Any]] | None,
    problems: bool,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """The allreduce test job's result: started early (one machine), now, or skipped."""
    if early is not None:
        result = early.result()
        # With problems found meanwhile, its failure would only repeat them.
        return {"skipped": "the problems above would stop the job"} if problems else result
    if not options.allreduce:
        return {"skipped": "--no-allreduce"}
    if problems:
        return {"skipped": "the problems above would stop the job"}
    say("running the allreduce test job")
    return _run_allreduce(options)


def examine(options: DoctorOptions, say: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Run every check; the result is the ``--json`` document."""
    t0 = time.monotonic()
    problems: list[str] = []
    warnings: list[str] = []
    timings: dict[str, float] = {}
    hosts = list(options.hosts)
    early: Future[dict[str, Any]] | None = None
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        if options.allreduce and all(h.is_local for h in hosts):
            # Only this machine: nothing to wait for, so the job starts while the probe runs.
            say("running the allreduce test job")
            early = pool.submit(_run_allreduce, options)
        say(f"probing {len(hosts)} host(s): {', '.join(h.name for h in hosts)}")
        probes = gather.probe_hosts(hosts, options.reach, options.probe_timeout_s)
        timings["probe"] = time.monotonic() - t0
        p_host, w_host = findings.check_hosts([p.to_dict() for p in probes], environ.current())
        problems += p_host
        warnings += w_host
        healthy = [h for h, p in zip(hosts, probes) if p.facts is not None]
        net, chosen, net_problem = _network(probes, options.network_interface)
        if net_problem:
            problems.append(net_problem)
        links: dict[str, Any] = {"skipped": None, "pairs": []}
        if len(hosts) < 2:
            links["skipped"] = "one host"
        elif not options.links:
            links["skipped"] = "--no-links"
        elif chosen is None or len(healthy) < 2:
            links["skipped"] = "no common network between reachable hosts"
        else:
            say(f"testing links between {len(healthy)} hosts ({options.link_seconds:g} s per pair)")
            t1 = time.monotonic()
            links.update(_links(options, [h for h in healthy if h.name in chosen], chosen))
            timings["links"] = time.monotonic() - t1
            analysis: findings.LinkAnalysis = links.pop("_analysis")
            problems += analysis.problems
            warnings += analysis.warnings

        result_ar = _allreduce_job(options, early, bool(problems), say)
        if "seconds" in result_ar:
            timings["allreduce"] = result_ar["seconds"]
        if result_ar.get("error"):
            problems.append(str(result_ar["error"]))
    finally:
        pool.shutdown(wait=True)

    place, counts, p_place, w_place = _placement(options, probes)
    problems += p_place
    warnings += w_place
    for p in probes:
        if p.facts is not None:
            warnings += findings.check_cpus(p.name, p.facts, (counts or {}).get(p.name, 1))
    compute = None
    if result_ar.get("allreduce"):  # the job ran: every rank's compute rate is in it
        compute = speed.examine(result_ar, counts)
    prediction = None
    if options.grad_bytes and options.step_time_s and counts:
        prediction = _prediction(options, counts, links, result_ar)
    if prediction and prediction.get("best_synchronous_efficiency") is not None:
        problems += _too_slow(prediction)
    code = 1 if problems else 0
    return {
        "version": REPORT_VERSION,
        "ok": not problems,
        "exit_code": code,
        "seconds": round(time.monotonic() - t0, 2),
        "timings": {k: round(v, 2) for k, v in timings.items()},
        "hosts": [p.to_dict() for p in probes],
        "network": net,
        "links": links,
        "allreduce": result_ar,
        "placement": place,
        "compute": compute,
        "prediction": prediction,
        "problems": problems,
        "warnings": warnings,
    }
