"""The doctor's human-readable report: the ``--json`` document as tables. Pure: dict in, text out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.doctor import speed
from ringtrain.doctor.findings import mbit
from ringtrain.environ import Threads


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:g} B"


def _dur(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _backends(torch: Mapping[str, Any]) -> str:
    if torch.get("error"):
        return "-"
    names = [b for b in ("gloo", "nccl", "mpi") if torch.get(b)]
    cuda = torch.get("cuda") or {}
    gpus = len(cuda.get("devices") or [])
    if gpus:
        names.append(f"cuda {cuda.get('version')} x{gpus}")
    return ",".join(names) or "none"


def _threads(facts: Mapping[str, Any]) -> str:
    env = facts.get("threads_env") or {}
    torch = facts.get("torch") or {}
    parts = [
        f"OMP={env.get(Threads.OMP_NUM_THREADS, 'unset')}",
        f"MKL={env.get(Threads.MKL_NUM_THREADS, 'unset')}",
    ]
    if torch.get("num_threads"):
        parts.append(f"torch={torch['num_threads']}")
    quota = (facts.get("cpu") or {}).get("quota")
    if quota is not None:
        parts.append(f"cpu-quota={quota:g}")
    return " ".join(parts)


def _allocator(facts: Mapping[str, Any]) -> str:
    alloc = facts.get("allocator") or {}
    pre = alloc.get("preloaded") or []
    avail = sorted((alloc.get("available") or {}).keys())
    used = ",".join(p.split(".so")[0].removeprefix("lib") for p in pre) if pre else "system"
    return used + (f" (has {','.join(avail)})" if avail else "")


def _hosts(doc: Mapping[str, Any]) -> list[str]:
    rows = [
        [
            "host",
            "ssh",
            "python",
            "ringtrain",
            "torch",
            "backends",
            "cores l/p/usable",
            "HT",
            "NUMA",
            "allocator",
            "threads",
        ]
    ]
    for h in doc["hosts"]:
        f = h.get("facts") or {}
        if not f:
            rows.append([h["name"], "ok" if h["reachable"] else "FAILED"] + ["-"] * 9)
            continue
        cpu = f.get("cpu") or {}
        torch = f.get("torch") or {}
        rows.append(
            [
                h["name"],
                "ok",
                str(f.get("python")),
                str(f.get("ringtrain")),
                "MISSING" if torch.get("error") else str(torch.get("version")),
                _backends(torch),
                f"{cpu.get('logical')}/{cpu.get('physical')}/{cpu.get('usable')}",
                "yes" if cpu.get("hyperthreading") else "no",
                str(len(f.get("numa_nodes") or []) or 1),
                _allocator(f),
                _threads(f),
            ]
        )
    lines = ["Hosts", *_table(rows)]
    lines.append("Interfaces")
    for h in doc["hosts"]:
        f = h.get("facts") or {}
        shown = [
            f"{i['name']} {i['address']}/{i['prefixlen']}" + ("" if i.get("is_up") else " (down)")
            for i in f.get("interfaces") or []
            if i.get("address")
        ]
        lines.append(f"  {h['name']}: {', '.join(shown) or '-'}")
    return lines


def _network(doc: Mapping[str, Any]) -> list[str]:
    net = doc.get("network") or {}
    if net.get("note"):
        return [f"Network: {net['note']}"]
    refused = net.get("refused_interface")
    if net.get("error") and not refused:
        return ["Network: NO COMMON SUBNET (see problems)"]
    chosen = net.get("chosen") or {}
    shown = ", ".join(f"{h} {i['name']} {i['address']}" for h, i in chosen.items())
    subnets = ", ".join(net.get("routable_subnets") or []) or "-"
    lines = [f"Network: subnets routed between all hosts: {subnets}"]
    lines += [f"  not routed: {u}" for u in net.get("unrouted_subnets") or []]
    if refused:  # the hosts may well connect: the name given is what is wrong
        return [*lines, f"  --network-interface {refused!r} REFUSED (see problems)"]
    return [*lines, f"  the job would use: {shown}"]


def _links(doc: Mapping[str, Any]) -> list[str]:
    links = doc.get("links") or {}
    if links.get("skipped"):
        return [f"Links: skipped ({links['skipped']})"]
    pairs = links.get("pairs") or []
    names = list(dict.fromkeys([p["src"] for p in pairs] + [p["dst"] for p in pairs]))
    slow = {(p["src"], p["dst"]) for p in links.get("slow_pairs") or []}
    cell: dict[tuple[str, str], str] = {}
    for p in pairs:
        if p.get("error"):
            cell[(p["src"], p["dst"])] = "FAILED"
        else:
            mark = " SLOW" if (p["src"], p["dst"]) in slow else ""
            cell[(p["src"], p["dst"])] = f"{mbit(p['bytes_per_s'])} {p['rtt_s'] * 1e3:.2f}ms{mark}"
    rows = [["from \\ to", *names]]
    for s in names:
        rows.append([s, *[("-" if s == d else cell.get((s, d), "?")) for d in names]])
    return ["Links (bandwidth, round trip)", *_table(rows)]


def _allreduce(doc: Mapping[str, Any]) -> list[str]:
    ar = doc.get("allreduce") or {}
    if ar.get("skipped"):
        return [f"Allreduce: skipped ({ar['skipped']})"]
    if ar.get("error"):
        return ["Allreduce: FAILED (see problems)"]
    head = (
        f"Allreduce bus bandwidth ({ar.get('world')} ranks on {', '.join(ar.get('hosts') or [])})"
    )
    rows = [["size", "time", "bus bandwidth"]]
    for p in ar.get("allreduce") or []:
        rows.append([_size(p["bytes"]), f"{p['seconds'] * 1e3:.2f} ms", mbit(p["busbw"])])
    return [head, *_table(rows)]


def _placement(doc: Mapping[str, Any]) -> list[str]:
    pl = doc.get("placement") or {}
    if pl.get("skipped"):
        return [f"Placement: not checked ({pl['skipped']})"]
    if pl.get("error"):
        return [f"Placement of -np {pl.get('np')}: IMPOSSIBLE (see problems)"]
    shown = ", ".join(f"{h} {c}" for h, c in (pl.get("ranks_per_host") or {}).items())
    verdict = "UNEVEN" if pl.get("uneven") else "even"
    lines = [
        f"Placement of -np {pl.get('np')}: {pl.get('pattern')} ({shown}) {verdict}; "
        f"~{pl.get('compute_efficiency', 1.0):.0%} of cores useful in lock-step"
    ]
    return lines + _connections(doc)


def _connections(doc: Mapping[str, Any]) -> list[str]:
    c = (doc.get("placement") or {}).get("connections")
    if not c:
        return []
    sockets = c["sockets_per_rank"]
    limits = ", ".join(
        f"{h['name']} {'/'.join(_limit(x) for x in h['facts']['open_files'])}"
        for h in doc["hosts"]
        if (h.get("facts") or {}).get("open_files")
    )
    return [
        f"Connections per rank at -np {c['ranks']} (computed, ringtrain.host.connections): "
        f"{sockets.get('rings')} sockets on rings only, {sockets.get('horovod')} on the defaults "
        f"(sums in rank order connect every pair), {sockets.get('horovod+direct')} with the "
        f"optimizer's direct rounds; up to {c['files_up_to']} files, so `ringtrain run` raises "
        f"a lower soft open-file limit to {c['open_files_needed']}"
        + (f" (soft/hard now: {limits})" if limits else "")
    ]


def _limit(n: int) -> str:
    return "unlimited" if n < 0 else str(n)


def _compute(doc: Mapping[str, Any]) -> list[str]:
    return speed.render(doc.get("compute"))


def _prediction(doc: Mapping[str, Any]) -> list[str]:
    pr = doc.get("prediction")
    if not pr:
        return []
    if pr.get("skipped"):
        return [f"Prediction: skipped ({pr['skipped']})"]
    lines = [
        f"Prediction for {_size(pr['grad_bytes'])} of gradients, {pr['step_time_s'] * 1e3:g} ms "
        f"per step, {pr['world']} ranks"
    ]
    rows = [["compression", "comm/step", "step", "efficiency", "speed-up"]]
    for p in pr["by_compression"]:
        rows.append(
            [
                p["choice"]["compression"],
                _dur(p["comm_s"]),
                _dur(p["step_s"]),
                f"{p['efficiency']:.0%}",
                f"{p['speedup']:.1f}x",
            ]
        )
    lines += _table(rows)
    local = pr.get("local_updates") or []
    if local:
        rows = [["sync_every", "exchange", "step", "efficiency", "speed-up"]]
        for p in local:
            rows.append(
                [
                    str(p["sync_every"]),
                    _dur(p["comm_s"]),
                    _dur(p["step_s"]),
                    f"{p['efficiency']:.0%}",
                    f"{p['speedup']:.1f}x",
                ]
            )
        lines += _table(rows)
    rec = pr["recommended"]["choice"]
    lines.append(
        f"  recommended: compression={rec['compression']} "
        f"backward_passes_per_step={rec['backward_passes_per_step']} "
        f"hierarchical={'on' if rec['hierarchical'] else 'off'}"
    )
    lines += [f"  - {r}" for r in pr.get("reasons") or []]
    return lines


def _indent(text: str) -> str:
    first, *rest = text.splitlines() or [""]
    return "\n".join([f"  - {first}", *[f"    {r}" for r in rest]])


def render(doc: Mapping[str, Any]) -> str:
    names = ", ".join(h["name"] for h in doc["hosts"])
    lines = [f"ringtrain doctor: {len(doc['hosts'])} host(s): {names}", ""]
    for part in (_hosts, _network, _links, _allreduce, _placement, _compute, _prediction):
        got = part(doc)
        if got:
            lines += [*got, ""]
    if doc["problems"]:
        lines.append(f"Problems that will stop a job ({len(doc['problems'])}):")
        lines += [_indent(p) for p in doc["problems"]]
    if doc["warnings"]:
        lines.append(f"Warnings ({len(doc['warnings'])}):")
        lines += [_indent(w) for w in doc["warnings"]]
    verdict = "OK" if doc["ok"] else "NOT READY"
    extra = f", {len(doc['warnings'])} warning(s)" if doc["warnings"] else ""
    lines.append(
        f"verdict: {verdict} ({len(doc['problems'])} problem(s){extra}) in {doc['seconds']:.1f} s"
    )
    return "\n".join(lines)
