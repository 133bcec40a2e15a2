"""Turning benchmark results into tables (plain or Markdown), JSON files and PNG plots.

Results stay plain dataclasses; this module only presents them. Bandwidths print in MB/s
(10^6 bytes), sizes in KiB/MiB, times in milliseconds with their min-max spread.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.bench.allreduce import AllreduceResult, SizePoint
from ringtrain.bench.checks import ChecksResult
from ringtrain.bench.secure import IMPLS as SECURE_IMPLS
from ringtrain.bench.secure import MODES, SecureResult
from ringtrain.bench.stats import Summary
from ringtrain.bench.train import TrainResult
from ringtrain.bench.units import fmt_bytes


def _num(x: float) -> str:
    """3 significant digits without exponents: 0.819, 7.32, 60.2, 369, 2470."""
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}"


def _ms(s: Summary) -> str:
    return f"{_num(s.median * 1e3)} [{_num(s.min * 1e3)}-{_num(s.max * 1e3)}]"


def _load(env: Mapping[str, Any]) -> str:
    before, after = env.get("load_before"), env.get("load_after")
    if before is None:
        return ""
    return f"; load average {before} before, {after} after, on {env.get('cpus')} cpus"


def _lane_line(lanes: Mapping[str, Any]) -> list[str]:
    """How many of ringtrain's timed ops per size took the fast lane (runs before 2026-12-04
    kept only the slots, warm-up included: left out)."""
    parts = [
        f"{fmt_bytes(int(size))} {v['taken']} of {v['timed']}"
        + (f" ({v['lost']} lost)" if v["lost"] else "")
        for size, v in lanes.items()
        if isinstance(v, Mapping)
    ]
    return [f"ringtrain's timed ops on the fast lane: {', '.join(parts)}"] if parts else []


def _mbs(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.0f}"


def _ratio(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{x * 100:.0f}%" if pct else f"{x:.2f}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def format_allreduce(res: AllreduceResult, markdown: bool = False) -> str:
    link = res.params.link_mbps
    link_bps = link * 1e6 / 8 if link else None
    by = {(p.impl, p.nbytes): p for p in res.sizes}
    sizes = sorted({p.nbytes for p in res.sizes})
    tcp = any(p.impl == "tcp" for p in res.sizes)
    headers = ["size", "ringtrain ms", "torch ms", "ringtrain MB/s", "torch MB/s", "rt/torch"]
    headers += ["rt/torch paired"]
    if tcp:
        headers += ["tcp ms", "tcp MB/s", "tcp/torch"]
    if link_bps:
        headers += ["rt/link", "torch/link"] + (["tcp/link"] if tcp else [])
    rows = []
    for nbytes in sizes:
        rt, tt = by[("ringtrain", nbytes)], by[("torch", nbytes)]
        ratio = rt.busbw.median / tt.busbw.median if tt.busbw.median else None
        row = [
            fmt_bytes(nbytes),
            _ms(rt.time),
            _ms(tt.time),
            _mbs(rt.busbw.median),
            _mbs(tt.busbw.median),
            _ratio(ratio),
            _paired(rt.paired),
        ]
        if tcp:
            tc = by[("tcp", nbytes)]
            tratio = tc.busbw.median / tt.busbw.median if tt.busbw.median else None
            row += [_ms(tc.time), _mbs(tc.busbw.median), _ratio(tratio)]
        if link_bps:
            row += [
                _ratio(rt.busbw.median / link_bps, True),
                _ratio(tt.busbw.median / link_bps, True),
            ]
            if tcp:
                row += [_ratio(by[("tcp", nbytes)].busbw.median / link_bps, True)]
        rows.append(row)
    out = [
        f"allreduce: {res.world_size} ranks, {res.params.dtype}, {res.params.repeats} repeats "
        "per size; times per op, median [min-max] of the slowest rank; bus bandwidth = "
        "2(n-1)/n * bytes / time; rt/torch of the medians, and repeat by repeat (paired: "
        "median [min-max])" + _load(res.environment),
        table(headers, rows, markdown),
        *_lane_line(res.environment.get("lane_slots") or {}),
    ]
    if res.reducescatter:
        out += ["", *_reducescatter_table(res, link_bps, markdown)]
    elif res.params.reducescatter:
        out += ["", "reducescatter: not timed, one rank moves nothing (run with -np 2 or more)"]
    if res.fusion:
        f0 = res.fusion[0]
        rows = [
            [
                p.case,
                str(p.tensors),
                _ms(p.time),
                _mbs(p.busbw.median),
                _ratio(p.vs_one_tensor),
                _paired(p.paired),
            ]
            for p in res.fusion
        ]
        out += [
            "",
            f"fusion: {res.params.fusion_count} x {fmt_bytes(res.params.fusion_each_bytes)} "
            f"= {fmt_bytes(f0.nbytes)}, {res.params.fusion_repeats} repeats; "
            "time relative to torch's single allreduce of the same bytes (of the medians, and "
            "repeat by repeat: median [min-max])",
            table(["case", "tensors", "ms", "MB/s", "vs one tensor", "paired"], rows, markdown),
        ]
    return "\n".join(out)


def _reducescatter_table(res: AllreduceResult, link_bps: float | None, markdown: bool) -> list[str]:
    by = {(p.impl, p.nbytes): p for p in res.reducescatter}
    headers = ["size", "ringtrain ms", "torch ms", "ringtrain MB/s", "torch MB/s"]
    headers += ["rt/torch paired"] + (["rt/link", "torch/link"] if link_bps else [])
    rows = []
    for nbytes in sorted({p.nbytes for p in res.reducescatter}):
        rt, tt = by[("ringtrain", nbytes)], by[("torch", nbytes)]
        row = [fmt_bytes(nbytes), _ms(rt.time), _ms(tt.time), _mbs(rt.busbw.median)]
        row += [_mbs(tt.busbw.median), _paired(rt.paired)]
        if link_bps:
            row += [
                _ratio(rt.busbw.median / link_bps, True),
                _ratio(tt.busbw.median / link_bps, True),
            ]
        rows.append(row)
    return [
        "reducescatter (Sum) of each size's bytes: ringtrain.reducescatter vs torch's "
        "reduce_scatter_tensor, interleaved; bus bandwidth = (n-1)/n * bytes / time",
        table(headers, rows, markdown),
    ]


def _paired(s: Summary | None) -> str:
    return "-" if s is None else f"{s.median:.2f}x [{s.min:.2f}-{s.max:.2f}]"


def _bw(s: Summary) -> str:
    return f"{_mbs(s.median)} [{_mbs(s.min)}-{_mbs(s.max)}]"


def format_secure(res: SecureResult, markdown: bool = False) -> str:
    """Bus bandwidth per size of gloo, ringtrain plain, ringtrain secure and the sealed group,
    with the ratios secure/plain (ringtrain) and sealed/gloo (the raw groups)."""
    link = res.params.link_mbps
    link_bps = link * 1e6 / 8 if link else None
    by = {(p.impl, p.nbytes): p for p in res.sizes}
    impls = [i for m in MODES for i in SECURE_IMPLS[m]]
    headers = ["size", *(f"{i} MB/s" for i in impls), "secure/plain", "sealed/gloo"]
    if link_bps:
        headers += ["gloo/link", "plain/link", "secure/link"]
    rows = []
    for nbytes in sorted({p.nbytes for p in res.sizes}):
        med = {i: by[(i, nbytes)].busbw.median for i in impls}
        row = [fmt_bytes(nbytes), *(_bw(by[(i, nbytes)].busbw) for i in impls)]
        row += [
            _ratio(med["ringtrain-secure"] / med["ringtrain"] if med["ringtrain"] else None),
            _ratio(med["sealed"] / med["gloo"] if med["gloo"] else None),
        ]
        if link_bps:
            row += [
                _ratio(med[i] / link_bps, True) for i in ("gloo", "ringtrain", "ringtrain-secure")
            ]
        rows.append(row)
    inits = ", ".join(f"{m} {_ms(s)} ms" for m, s in res.init_time.items())
    return "\n".join(
        [
            f"allreduce, plain vs secure: {res.world_size} ranks, float32, {res.params.repeats} "
            "phases per mode, modes and cases alternating; bus bandwidth = 2(n-1)/n * bytes / "
            "time of the slowest rank, MB/s median [min-max]" + _load(res.environment),
            table(headers, rows, markdown),
            f"ringtrain.init per phase, median [min-max]: {inits}",
        ]
    )


def format_checks(res: ChecksResult, markdown: bool = False) -> str:
    """Time per op with consistency checks on and off, the paired ratio, and the check alone."""
    rows = [
        [
            p.case,
            _ms(p.on),
            _ms(p.off),
            f"{p.ratio.median:.3f} [{p.ratio.min:.3f}-{p.ratio.max:.3f}]",
            _share(res.share_cached.get(p.case)),
            _share(res.share_first.get(p.case)),
        ]
        for p in res.points
    ]
    out = [
        f"consistency checks: {res.world_size} ranks, {res.params.repeats} phases per setting, "
        "settings and cases alternating; ms per op (per step for a step), median [min-max] of "
        "the slowest rank; on/off paired per repeat" + _load(res.environment),
        table(
            ["case", "checks on ms", "checks off ms", "on/off", "check share", "first run"],
            rows,
            markdown,
        ),
    ]
    if res.check_cached_us is not None and res.check_first_us is not None:
        c, f = res.check_cached_us, res.check_first_us
        out.append(
            f"the check alone, mismatch() over {res.world_size} equal one-tensor requests, us per "
            f"collective: {c.median:.2f} [{c.min:.2f}-{c.max:.2f}] from the request cache, "
            f"{f.median:.2f} [{f.min:.2f}-{f.max:.2f}] on a name's first run; check share = "
            "that times the collectives per op, over the op's median time with checks off"
        )
    return "\n".join(out)


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.2g}%"


def format_train(res: TrainResult, markdown: bool = False) -> str:
    p = res.params
    head = (
        f"train: {res.model} ({res.parameters / 1e6:.1f}M params, {fmt_bytes(res.gradient_bytes)} "
        f"of gradients), {res.world_size} ranks, batch {res.batch_size}/rank x "
        f"{p.backward_passes_per_step} pass(es) = {res.samples_per_step} samples/step, "
        f"optimizer {p.optimizer}, compression {p.compression} (ddp: {res.ddp_compression}), "
        f"{p.steps} steps/variant "
        f"in blocks of {p.block} after {p.warmup} warm-up; step time of the slowest rank, "
        "median [min-max]; CPU per step: every thread of every rank, summed"
        + _load(res.environment)
    )
    if res.peak_rss_bytes:
        head += (
            f"\noptimizer {p.optimizer}; peak RSS of the largest rank {fmt_bytes(res.peak_rss_bytes)}"
            f" ({fmt_bytes(res.base_rss_bytes)} before the model was built)"
        )
    extra = [f"{v.variant} {v.warmup_steps}" for v in res.variants if v.warmup_steps > p.warmup]
    if extra:
        head += "\nwarm-up steps until steady (PowerSGD start, auto's choice): " + ", ".join(extra)
    rows = [
        [
            v.variant + (f" ({v.chosen})" if v.chosen else ""),
            _ms(v.step_time),
            f"{v.step_time.spread * 100:.0f}%",
            f"{v.steps_per_s:.2f}",
            f"{v.samples_per_s:.1f}",
            _ratio(v.vs_ddp),
            _paired(v.paired_vs_ddp),
            _ratio(v.vs_nocomm),
            _ratio(v.comm_fraction, True),
            f"{v.cpu_per_step * 1e3:.0f}",
            _ratio(v.cpu_vs_ddp),
            fmt_bytes(v.state_bytes),
        ]
        for v in res.variants
    ]
    headers = [
        "variant",
        "step ms",
        "IQR",
        "steps/s",
        "samples/s",
        "vs ddp",
        "vs ddp, paired",
        "vs nocomm",
        "comm share",
        "CPU ms/step",
        "CPU over ddp's",
        "opt state/rank",
    ]
    return head + "\n" + table(headers, rows, markdown)


def to_json(
    result: Any, benchmark: str, options: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``{"benchmark", "options", "result"}``: the result dataclass as plain JSON values."""
    return {
        "benchmark": benchmark,
        "options": dict(options or {}),
        "result": dataclasses.asdict(result),
    }


def save_json(
    path: str, result: Any, benchmark: str, options: Mapping[str, Any] | None = None
) -> None:
    _parent(path)
    with open(path, "w") as f:
        json.dump(to_json(result, benchmark, options), f, indent=2)
        f.write("\n")


def _parent(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)


def plot_allreduce(res: AllreduceResult, path: str) -> None:
    plt = _pyplot()
    ncols = 2 if res.fusion else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.2), squeeze=False)
    impls = ("ringtrain", "torch", "tcp") if res.params.tcp else ("ringtrain", "torch")
    _busbw_panel(axes[0][0], res.sizes, impls, res.params.link_mbps)
    axes[0][0].set_title(f"allreduce, {res.world_size} ranks (median, min-max)")
    if res.fusion:
        ax = axes[0][1]
        names = [p.case for p in res.fusion]
        med = [p.time.median * 1e3 for p in res.fusion]
        err = [
            [m - p.time.min * 1e3 for p, m in zip(res.fusion, med)],
            [p.time.max * 1e3 - m for p, m in zip(res.fusion, med)],
        ]
        ax.barh(names, med, xerr=err, capsize=3, color="tab:blue")
        ax.set_xlabel("ms for all tensors")
        ax.set_title(
            f"{res.params.fusion_count} x {fmt_bytes(res.params.fusion_each_bytes)} tensors"
        )
        ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)


def _busbw_panel(
    ax: Any, points: Sequence[SizePoint], impls: Sequence[str], link_mbps: float | None
) -> None:
    """Bus bandwidth vs message size, one line per implementation, with min-max error bars."""
    for impl in impls:
        pts = sorted((p for p in points if p.impl == impl), key=lambda p: p.nbytes)
        x = [p.nbytes for p in pts]
        y = [p.busbw.median / 1e6 for p in pts]
        err = [
            [m - p.busbw.min / 1e6 for p, m in zip(pts, y)],
            [p.busbw.max / 1e6 - m for p, m in zip(pts, y)],
        ]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=impl)
    if link_mbps:
        ax.axhline(link_mbps / 8, color="grey", ls="--", label="link rate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({p.nbytes for p in points})
    ax.set_xticks(sizes, [fmt_bytes(s) for s in sizes], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (MB/s)")
    ax.grid(True, alpha=0.3)
    ax.legend()


def plot_secure(res: SecureResult, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    impls = [i for m in MODES for i in SECURE_IMPLS[m]]
    _busbw_panel(ax, res.sizes, impls, res.params.link_mbps)
    ax.set_title(f"allreduce, plain vs secure, {res.world_size} ranks (median, min-max)")
    _save(fig, path)


def plot_checks(res: ChecksResult, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 0.6 * len(res.points) + 1.8))
    names = [p.case for p in res.points]
    med = [p.ratio.median for p in res.points]
    err = [
        [m - p.ratio.min for p, m in zip(res.points, med)],
        [p.ratio.max - m for p, m in zip(res.points, med)],
    ]
    ax.barh(names, med, xerr=err, capsize=3, color="tab:blue")
    ax.axvline(1.0, color="grey", ls="--")
    ax.set_xlabel("time with checks on / off (median, min-max of paired repeats)")
    ax.set_title(f"consistency checks, {res.world_size} ranks")
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)


def plot_train(res: TrainResult, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    names = [v.variant for v in res.variants]
    med = [v.steps_per_s for v in res.variants]
    err = [
        [m - 1 / v.step_time.max for v, m in zip(res.variants, med)],
        [1 / v.step_time.min - m for v, m in zip(res.variants, med)],
    ]
    bars = ax.bar(names, med, yerr=err, capsize=4, color="tab:blue")
    for bar, v in zip(bars, res.variants):
        if v.comm_fraction is not None and v.variant != "nocomm":
            ax.annotate(
                f"comm {v.comm_fraction * 100:.0f}%",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                xytext=(0, 4),
                textcoords="offset points",
            )
    ax.set_ylabel("steps/s (median, min-max)")
    ax.tick_params(axis="x", labelrotation=20)  # ringtrain:NAME labels are long
    ax.set_title(f"{res.model}, {res.world_size} ranks, compression {res.params.compression}")
    ax.grid(True, axis="y", alpha=0.3)
    _save(fig, path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers or CI
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> None:
    import matplotlib.pyplot as plt

    _parent(path)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
