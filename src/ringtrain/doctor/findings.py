"""What the doctor concludes from what it gathered: problems that stop a job, and warnings.

Problems (the doctor exits non-zero): a host that ssh cannot reach, a host where the probe
cannot run (no Python, no ringtrain), a host without torch or torch.distributed, different torch
or ringtrain versions across hosts, no subnet routed between all hosts, a link test or the
allreduce job that fails. Warnings (exit 0): slow links, high latency, an uneven placement,
more threads than cores, a CPU quota without exclusive cores (a shared pool), and a rank that
the binding plan would give two hardware threads of one core (:func:`check_cpus`).

Slow links. Every pair of hosts is measured in both directions. One host's slow network card
(or a shaped link) slows every pair that host is in, so the median over *pairs* can be the slow
value itself (with 3 hosts, 4 of the 6 pairs touch the slow one). So each host gets a capacity,
the fastest pair it is part of (its link is at least that fast), and the reference is the
median host capacity: a host below ``SLOW_FACTOR`` of it has a slow link, and so does any pair
below ``SLOW_FACTOR`` of it (which also catches a slow path between two fast hosts). Such a
pair is named only if it stays slow beside its hosts' other links measured right after it
(:func:`slow_beside`): a fast link on a busy host is CPU-bound, and one measured while another
process held the cores can read at half the figure its reverse got a moment earlier.

Pure: dicts and numbers in, strings and numbers out.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringtrain.environ import Torch
from ringtrain.host import connections, open_files
from ringtrain.host.cpu_limits import is_shared_pool, shared_cores
from ringtrain.launch.tuning import HostFacts, tune

# The same factor the straggler report uses for a slow host link.
SLOW_FACTOR = 0.5
# A pair's round trip is high above this multiple of the median, and at least HIGH_RTT_S.
HIGH_RTT_FACTOR = 4.0
HIGH_RTT_S = 0.5e-3


# A link too slow for useful data-parallel training: at TRAINING_EFFICIENCY, with a step of
# REFERENCE_STEP_S of compute and nothing hidden behind it, two ranks' ring allreduce over it
# carries under USEFUL_GRAD_BYTES of gradients per step (16 MiB: 4M fp32 parameters). About
# 500 Mbit/s; a 100 Mbit/s link carries 3 MiB, a 10 Mbit/s one 0.3 MiB.
TRAINING_EFFICIENCY = 0.8
REFERENCE_STEP_S = 1.0
USEFUL_GRAD_BYTES = 16 << 20


def carried_grad_bytes(
    bytes_per_s: float,
    step_s: float = REFERENCE_STEP_S,
    efficiency: float = TRAINING_EFFICIENCY,
    ranks: int = 2,
) -> float:
    """Gradient bytes per step a ring allreduce over a link of ``bytes_per_s`` moves within
    the communication a step of ``step_s`` can add at ``efficiency`` (none of it hidden)."""
    budget_s = step_s * (1 / efficiency - 1)
    return budget_s * bytes_per_s * ranks / (2 * max(ranks - 1, 1))


def mbit(bytes_per_s: float) -> str:
    v = bytes_per_s * 8 / 1e6
    return f"{v:,.0f} Mbit/s" if v >= 100 else f"{v:.3g} Mbit/s"


@dataclass(frozen=True)
class LinkSample:
    src: str
    dst: str
    bytes_per_s: float | None = None
    rtt_s: float | None = None
    error: str | None = None


@dataclass
class LinkAnalysis:
    host_capacity: dict[str, float] = field(default_factory=dict)
    reference: float | None = None
    slow_hosts: list[str] = field(default_factory=list)
    slow_pairs: list[tuple[str, str]] = field(default_factory=list)
    # Below the factor at first, but not beside their hosts' links in a retest (slow_beside).
    cleared_pairs: list[tuple[str, str]] = field(default_factory=list)
    high_latency: list[tuple[str, str]] = field(default_factory=list)
    slowest: float | None = None
    median_rtt_s: float | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host_capacity_bytes_per_s": dict(self.host_capacity),
            "reference_bytes_per_s": self.reference,
            "slowest_bytes_per_s": self.slowest,
            "median_rtt_s": self.median_rtt_s,
            "slow_hosts": list(self.slow_hosts),
            "slow_pairs": [{"src": s, "dst": d} for s, d in self.slow_pairs],
            "cleared_pairs": [{"src": s, "dst": d} for s, d in self.cleared_pairs],
            "high_latency_pairs": [{"src": s, "dst": d} for s, d in self.high_latency],
        }


Pair = tuple[str, str]


def reference_pairs(samples: Sequence[LinkSample], pair: Pair) -> list[Pair]:
    """The pairs that give ``pair``'s two hosts their capacity (each host's fastest other
    pair): what :func:`slow_beside` measures ``pair`` against."""
    good = [s for s in samples if s.error is None and s.bytes_per_s]
    out: list[Pair] = []
    for host in pair:
        others = [s for s in good if host in (s.src, s.dst) and (s.src, s.dst) != pair]
        if others:
            best = max(others, key=lambda s: s.bytes_per_s or 0.0)
            if (best.src, best.dst) not in out:
                out.append((best.src, best.dst))
    return out


def slow_beside(
    pair: Pair, round_samples: Sequence[LinkSample], factor: float = SLOW_FACTOR
) -> bool:
    """Whether ``pair`` is below ``factor`` of its hosts' capacity within one round that measured
    it and its :func:`reference_pairs` back to back (so under the same load). True where the
    round cannot say (a test failed, or no other pair of its hosts was measured)."""
    rates = {(s.src, s.dst): s.bytes_per_s for s in round_samples if s.error is None}
    rate = rates.get(pair)
    capacities = [
        max((r or 0.0 for p, r in rates.items() if p != pair and host in p), default=None)
        for host in pair
    ]
    known = [c for c in capacities if c]
    if not rate or not known:
        return True
    return rate < factor * min(known)


def analyze_links(
    samples: Sequence[LinkSample],
    factor: float = SLOW_FACTOR,
    cleared: Collection[Pair] = (),
) -> LinkAnalysis:
    """Slow hosts, slow pairs, high-latency pairs and failed tests among ``samples``;
    ``cleared``: pairs a retest found not slow beside their hosts' other links
    (:func:`slow_beside`), which are not named."""
    out = LinkAnalysis()
    good = [s for s in samples if s.error is None and s.bytes_per_s]
    for s in samples:
        if s.error is not None:
            out.problems.append(
                f"the link test from {s.src} to {s.dst} failed: {s.error}\n"
                f"HINT: ranks on {s.src} must open TCP connections to {s.dst} on any port; "
                "check firewalls (iptables, security groups) between the hosts."
            )
    if not good:
        return out
    for s in good:
        for h in (s.src, s.dst):
            out.host_capacity[h] = max(out.host_capacity.get(h, 0.0), s.bytes_per_s or 0.0)
    ref = statistics.median(out.host_capacity.values())
    out.reference = ref
    out.slowest = min(s.bytes_per_s or 0.0 for s in good)
    out.slow_hosts = sorted(h for h, c in out.host_capacity.items() if c < factor * ref)
    below = [(s.src, s.dst) for s in good if (s.bytes_per_s or 0.0) < factor * ref]
    out.slow_pairs = [p for p in below if p not in cleared]
    out.cleared_pairs = [p for p in below if p in cleared]
    for h in out.slow_hosts:
        pairs = [s for s in good if h in (s.src, s.dst)]
        shown = ", ".join(f"{s.src}->{s.dst} {mbit(s.bytes_per_s or 0.0)}" for s in pairs)
        out.warnings.append(
            f"host {h}'s link is slow: at most {mbit(out.host_capacity[h])}, under "
            f"{factor:.0%} of the median host ({mbit(ref)}); pairs: {shown}.\n"
            f"HINT: every allreduce runs at the pace of the slowest link; check {h}'s network "
            "card, cable, switch port and traffic shaping (tc), or leave it out of the job."
        )
    for src, dst in out.slow_pairs:
        if src in out.slow_hosts or dst in out.slow_hosts:
            continue  # already explained by the host
        rate = next(s.bytes_per_s for s in good if (s.src, s.dst) == (src, dst)) or 0.0
        out.warnings.append(
            f"the link from {src} to {dst} is slow: {mbit(rate)}, under {factor:.0%} of the "
            f"median host ({mbit(ref)}), although both hosts are fast with others.\n"
            "HINT: the path between them differs (another switch, a VPN, a routed hop)."
        )
    slowest = min(good, key=lambda s: s.bytes_per_s or 0.0)
    carried = carried_grad_bytes(out.slowest)
    # A slow host is named above (leave it out, and the rest is fast): this is for a slow fabric.
    if carried < USEFUL_GRAD_BYTES and not {slowest.src, slowest.dst} & set(out.slow_hosts):
        out.warnings.append(
            f"the link from {slowest.src} to {slowest.dst} ({mbit(out.slowest)}) is too slow "
            f"for useful data-parallel training: at {TRAINING_EFFICIENCY:.0%} efficiency, a "
            f"step of {REFERENCE_STEP_S:g} s of compute can carry {carried / 2**20:.2g} MiB of "
            f"gradients over it ({carried / 4:,.0f} fp32 parameters, twice that in 16 bits), "
            "and proportionally more for longer steps.\nHINT: train with local updates "
            "(DistributedOptimizer(sync_every=H), or RINGTRAIN_SYNC_EVERY=auto: the weights "
            "travel once every H steps; docs/engine.md); `ringtrain doctor --model-params N "
            "--step-time S` predicts each setting for your model."
        )
    rtts = [s.rtt_s for s in good if s.rtt_s is not None]
    if rtts:
        med = statistics.median(rtts)
        out.median_rtt_s = med
        for s in good:
            if s.rtt_s is not None and s.rtt_s > max(HIGH_RTT_FACTOR * med, HIGH_RTT_S):
                out.high_latency.append((s.src, s.dst))
                out.warnings.append(
                    f"high latency from {s.src} to {s.dst}: {s.rtt_s * 1e3:.2f} ms round trip "
                    f"(median {med * 1e3:.2f} ms).\nHINT: small allreduces pay it 2(n-1) times; "
                    "a larger fusion buffer (--fusion-threshold-mb) sends fewer of them."
                )
    return out


def _version_problem(what: str, by_host: Mapping[str, str]) -> str | None:
    if len(set(by_host.values())) <= 1:
        return None
    shown = ", ".join(f"{h} {v}" for h, v in by_host.items())
    return (
        f"{what} versions differ across hosts: {shown}.\n"
        f"HINT: install the same {what} version on every host; ranks of different versions "
        "cannot be relied on to agree on the wire format."
    )


def check_hosts(
    hosts: Sequence[Mapping[str, Any]], env: Mapping[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """Problems and warnings from the hosts' probe results.

    Each entry has ``name``, ``reachable`` (ssh worked), ``error`` (why the probe failed, or
    None) and ``facts`` (the probe's facts, or None). ``env``: the launcher's environment, where
    one is to be judged (:func:`check_kernels`).
    """
    problems: list[str] = []
    warnings: list[str] = []
    torch_versions: dict[str, str] = {}
    rt_versions: dict[str, str] = {}
    py_versions: dict[str, str] = {}
    gpus: dict[str, int] = {}
    for h in hosts:
        name = h["name"]
        if h.get("error"):
            problems.append(str(h["error"]))
            continue
        facts = h.get("facts") or {}
        torch = facts.get("torch") or {}
        if torch.get("error"):
            problems.append(
                f"torch cannot be imported on host {name} ({facts.get('executable', 'python')}): "
                f"{torch['error']}\nHINT: install torch in that Python environment, at the same "
                "version as on the other hosts."
            )
        else:
            torch_versions[name] = str(torch.get("version"))
            if not torch.get("distributed"):
                problems.append(
                    f"torch on host {name} was built without torch.distributed.\n"
                    "HINT: install an official torch build (pip install torch)."
                )
            elif not torch.get("gloo") and not torch.get("nccl"):
                problems.append(f"torch on host {name} has neither the Gloo nor the NCCL backend.")
            gpus[name] = len((torch.get("cuda") or {}).get("devices") or [])
            threads = torch.get("num_threads")
            usable = (facts.get("cpu") or {}).get("usable")
            if threads and usable and threads > usable:
                warnings.append(
                    f"host {name}: torch starts {threads} threads per process on {usable} usable "
                    "cores (OMP_NUM_THREADS?).\nHINT: unset OMP_NUM_THREADS and let "
                    "`ringtrain run` give each rank its share of the cores."
                )
        rt_versions[name] = str(facts.get("ringtrain"))
        py_versions[name] = str(facts.get("python"))
    for what, versions in (("torch", torch_versions), ("ringtrain", rt_versions)):
        msg = _version_problem(what, versions)
        if msg:
            problems.append(msg)
    if len(set(py_versions.values())) > 1:
        shown = ", ".join(f"{h} {v}" for h, v in py_versions.items())
        warnings.append(
            f"Python versions differ across hosts: {shown}.\nHINT: objects sent with "
            "broadcast_object/allgather_object are pickled; use one Python version everywhere."
        )
    if len(set(gpus.values())) > 1:
        shown = ", ".join(f"{h} {n}" for h, n in gpus.items())
        warnings.append(f"hosts have different numbers of CUDA devices: {shown}.")
    if env is not None:
        warnings += check_kernels(hosts, env)
    return problems, warnings


# ATen's CPU capabilities on x86, plainest first: each host runs the kernels of its best one.
_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


def check_kernels(hosts: Sequence[Mapping[str, Any]], env: Mapping[str, str]) -> list[str]:
    """A warning where the hosts' torch would pick different ATen CPU kernels: the same job's
    weights then differ in their last bits between hosts (and from a run on one host). None
    where ATEN_CPU_CAPABILITY is set here: ``ringtrain run`` forwards it to every host."""
    if env.get(Torch.ATEN_CPU_CAPABILITY):
        return []
    picked = {
        h["name"]: str(((h.get("facts") or {}).get("torch") or {}).get("cpu_capability"))
        for h in hosts
        if ((h.get("facts") or {}).get("torch") or {}).get("cpu_capability")
    }
    if len(set(picked.values())) < 2:
        return []
    shown = ", ".join(f"{h} {c}" for h, c in picked.items())
    known = set(picked.values()) <= set(_CAPABILITIES)
    plainest = min(picked.values(), key=_CAPABILITIES.index).lower() if known else "CAPABILITY"
    return [
        f"the hosts' torch picks different CPU kernels: {shown}; a job's weights will differ in "
        "their last bits between these hosts, and from the same job on one host.\n"
        f"HINT: ATEN_CPU_CAPABILITY={plainest} ringtrain run ... gives every host the same "
        "kernels (ringtrain run forwards it; with mpirun: -x ATEN_CPU_CAPABILITY); a value "
        "above what a host's CPU has kills its ranks with SIGILL."
    ]


def check_cpus(name: str, facts: Mapping[str, Any], ranks: int) -> list[str]:
    """Warnings about how ``ranks`` ranks would share this host's CPUs under ``ringtrain run``."""
    cpu = facts.get("cpu") or {}
    cpus = [int(c) for c in cpu.get("cpus") or ()]
    quota = cpu.get("quota")
    out: list[str] = []
    if cpus and is_shared_pool(len(cpus), quota):
        out.append(
            f"host {name}: a CPU quota of {quota:g} CPUs (cgroup cpu.max) but {len(cpus)} cores "
            "to run on: no exclusive cpuset, so these cores are shared with other pods or "
            "processes (Kubernetes CPU manager policy 'none', or a pod that is not Guaranteed "
            "with whole CPUs). Threads sized by the cores would be throttled; `ringtrain run` "
            "sizes them by the quota and binds nothing.\nHINT: for cores of its own, give the pod "
            "Guaranteed QoS with whole CPUs (requests = limits) on a node whose kubelet runs "
            "--cpu-manager-policy=static."
        )
    groups = [tuple(int(c) for c in g) for g in cpu.get("smt_groups") or ()]
    if cpus and groups and ranks > 0:
        siblings = {c: g for g in groups for c in g}
        plan = tune(
            HostFacts(name, tuple(cpus), tuple(tuple(n) for n in facts.get("numa_nodes") or ())),
            ranks,
            "auto",
            "system",
            {},
        )
        for local, t in enumerate(plan):
            shared = shared_cores(t.cpus or (), siblings)
            if shared:
                shown = ", ".join("+".join(map(str, g)) for g in shared)
                out.append(
                    f"host {name}: local rank {local} would be bound to CPUs that are hardware "
                    f"threads of one core ({shown}), so its {len(t.cpus or ())} threads get "
                    f"{len(t.cpus or ()) - sum(len(g) - 1 for g in shared)} cores.\nHINT: set "
                    "OMP_NUM_THREADS to the physical cores per rank, or turn SMT off for "
                    "compute-bound training."
                )
                break  # one warning per host says it
    return out


def connections_at(ranks: int) -> dict[str, int | dict[str, int]]:
    """What one rank of a job of ``ranks`` holds, computed (ringtrain.host.connections): its
    sockets for each usual mix of traffic, the most files, and the open-file limit the agent
    gives the ranks where a host's soft limit is lower."""
    return {
        "ranks": ranks,
        "sockets_per_rank": {
            name: connections.footprint(ranks, uses).sockets
            for name, uses in connections.PROFILES.items()
        },
        "files_up_to": connections.most_files(ranks),
        "open_files_needed": open_files.needed(ranks),
    }


def check_open_files(name: str, facts: Mapping[str, object], ranks: int) -> list[str]:
    """A warning where this host's hard open-file limit leaves a rank of a job of ``ranks``
    too few files (the agent raises the soft limit up to the hard one by itself)."""
    limits = facts.get("open_files")
    if not isinstance(limits, (list, tuple)) or len(limits) != 2 or ranks < 1:
        return []
    p = open_files.plan(ranks, int(limits[0]), int(limits[1]))
    line = open_files.message(p)
    return [f"host {name}: {line}"] if p.short and line else []
