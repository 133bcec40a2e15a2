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

from ringtrain.bench.allreduce import AllreduceResult
from ringtrain.bench.stats import Summary
from ringtrain.bench.train import TrainResult


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


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
    headers = ["size", "ringtrain ms", "torch ms", "ringtrain MB/s", "torch MB/s", "rt/torch"]
    if link_bps:
        headers += ["rt/link", "torch/link"]
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
        ]
        if link_bps:
            row += [
                _ratio(rt.busbw.median / link_bps, True),
                _ratio(tt.busbw.median / link_bps, True),
            ]
        rows.append(row)
    out = [
        f"allreduce: {res.world_size} ranks, {res.params.dtype}, {res.params.repeats} repeats "
        "per size; times per op, median [min-max] of the slowest rank; bus bandwidth = "
        "2(n-1)/n * bytes / time" + _load(res.environment),
        table(headers, rows, markdown),
    ]
    if res.fusion:
        f0 = res.fusion[0]
        rows = [
            [p.case, str(p.tensors), _ms(p.time), _mbs(p.busbw.median), _ratio(p.vs_one_tensor)]
            for p in res.fusion
        ]
        out += [
            "",
            f"fusion: {res.params.fusion_count} x {fmt_bytes(res.params.fusion_each_bytes)} "
            f"= {fmt_bytes(f0.nbytes)}, {res.params.fusion_repeats} repeats; "
            "time relative to torch's single allreduce of the same bytes",
            table(["case", "tensors", "ms", "MB/s", "vs one tensor"], rows, markdown),
        ]
    return "\n".join(out)


def format_train(res: TrainResult, markdown: bool = False) -> str:
    p = res.params
    head = (
        f"train: {res.model} ({res.parameters / 1e6:.1f}M params, {fmt_bytes(res.gradient_bytes)} "
        f"of gradients), {res.world_size} ranks, batch {res.batch_size}/rank x "
        f"{p.backward_passes_per_step} pass(es) = {res.samples_per_step} samples/step, "
        f"compression {p.compression} (ddp: {res.ddp_compression}), {p.steps} steps/variant "
        f"in blocks of {p.block} after {p.warmup} warm-up; step time of the slowest rank, "
        "median [min-max]" + _load(res.environment)
    )
    rows = [
        [
            v.variant,
            _ms(v.step_time),
            f"{v.step_time.spread * 100:.0f}%",
            f"{v.steps_per_s:.2f}",
            f"{v.samples_per_s:.1f}",
            _ratio(v.vs_ddp),
            _ratio(v.vs_nocomm),
            _ratio(v.comm_fraction, True),
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
        "vs nocomm",
        "comm share",
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
    ax = axes[0][0]
    for impl in ("ringtrain", "torch"):
        pts = sorted((p for p in res.sizes if p.impl == impl), key=lambda p: p.nbytes)
        x = [p.nbytes for p in pts]
        y = [p.busbw.median / 1e6 for p in pts]
        err = [
            [m - p.busbw.min / 1e6 for p, m in zip(pts, y)],
            [p.busbw.max / 1e6 - m for p, m in zip(pts, y)],
        ]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=impl)
    if res.params.link_mbps:
        ax.axhline(res.params.link_mbps / 8, color="grey", ls="--", label="link rate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({p.nbytes for p in res.sizes})
    ax.set_xticks(sizes, [fmt_bytes(s) for s in sizes], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (MB/s)")
    ax.set_title(f"allreduce, {res.world_size} ranks (median, min-max)")
    ax.grid(True, alpha=0.3)
    ax.legend()
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
