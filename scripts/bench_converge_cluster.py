"""``ringtrain bench converge`` on 2 namespace hosts at several link rates, interleaved, repeated.

One rank per host, one torch thread each (OMP_NUM_THREADS=1). Each pair is a fresh 2-host
cluster whose h0 link is shaped with ``tc tbf`` to the rate (both directions). The one-host
reference is the ``alone`` variant of the same job (every rank trains alone, as one host would:
the same per-step compute, threads and machine load, counted from the same point), so each
ratio compares runs that shared the machine's load. ``--rounds`` repeats every rate in turn
(rate A, rate B, rate A, ...) and the summary gives, per rate and variant, the median and the
spread (min-max) of the time to target relative to ``alone``, of the time per step relative to
``alone`` (throughput), and of the bytes per sample relative to DDP, with the 1-minute load
average before each run. Every run writes its JSON to ``--out``. Needs root (network
namespaces). Run::

    .venv/bin/python scripts/bench_converge_cluster.py --task digits --rates 10mbit,100mbit \\
        --rounds 3 -- --variants alone,ddp,local
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from ringtrain.testing import cluster as tc

PY = sys.executable


def _run(c: tc.Cluster, out: Path, extra: list[str], timeout: float) -> Any:
    argv = [PY, "-m", "ringtrain", "run", "--ssh-config-file", str(c.ssh_config_path)]
    argv += ["-H", "h0:1,h1:1", "-np", "2", "--start-timeout", "60", "-x", "OMP_NUM_THREADS=1"]
    if os.environ.get("PYTHONPATH"):  # another copy of src/ (before/after runs) on every host
        argv += ["-x", "PYTHONPATH"]
    argv += ["--", PY, "-m", "ringtrain.bench", "converge", "--threads", "1"]
    argv += ["--json", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr, flush=True)
        return None
    return json.loads(out.read_text())["result"]


def _load() -> float:
    return os.getloadavg()[0]


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.2f}x ({min(values):.2f}-{max(values):.2f}, n={len(values)})"


def summarize(runs: list[tuple[str, float, Any]]) -> list[str]:
    """Per rate and variant: time to target / alone's, ms per step / alone's, DDP's bytes per
    sample / the variant's (each the median and range over the rounds). A variant listed more
    than once in a job (``alone,local,alone,local``) is compared with the ``alone`` run just
    before it (the first, with the first ``alone``): the nearest in time, so the same load."""
    table: dict[tuple[str, str], dict[str, list[float]]] = {}
    loads: dict[str, list[float]] = {}
    for rate, load, res in runs:
        loads.setdefault(rate, []).append(load)
        if not res:
            continue
        alones = [r for r in res["runs"] if r["variant"] == "alone"]
        ddp = next((r for r in res["runs"] if r["variant"] == "ddp"), None)
        alone = alones[0] if alones else None
        for r in res["runs"]:
            if r["variant"] == "alone":
                alone = r
            row = table.setdefault(
                (rate, r["variant"]), {"time": [], "step": [], "bytes": [], "no": []}
            )
            if alone and alone["reached"] and r["reached"]:
                row["time"].append(r["seconds"] / alone["seconds"])
            elif not r["reached"]:
                row["no"].append(1.0)
            if alone:
                per = r["seconds"] / max(1, r["steps"])
                row["step"].append(per / (alone["seconds"] / max(1, alone["steps"])))
            if ddp and r["tx_bytes_per_sample"] > 0:
                row["bytes"].append(ddp["tx_bytes_per_sample"] / r["tx_bytes_per_sample"])
    lines = ["rate | variant | time to target vs alone | time per step vs alone | DDP B / its B"]
    for (rate, name), row in table.items():
        missed = f" [{len(row['no'])} not reached]" if row["no"] else ""
        lines.append(
            f"{rate} | {name} | {_spread(row['time'])}{missed} | {_spread(row['step'])} | "
            f"{_spread(row['bytes'])}"
        )
    for rate, values in loads.items():
        lines.append(
            f"{rate}: 1-minute load before the runs {', '.join(f'{v:.1f}' for v in values)}"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--task", default="digits")
    ap.add_argument("--rates", default="10mbit,100mbit")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="/tmp/ringtrain-converge")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("extra", nargs="*", help="more `bench converge` flags (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--task", args.task, *args.extra]
    runs: list[tuple[str, float, Any]] = []
    for i in range(args.rounds):
        for rate in [r for r in args.rates.split(",") if r]:
            load = _load()
            print(f"== round {i + 1}, {rate}, load {load:.1f}", flush=True)
            with tc.Cluster([tc.HostSpec(rate=rate), tc.HostSpec()]) as c:
                res = _run(c, out / f"{args.task}-{rate}-{i}.json", extra, args.timeout)
            runs.append((rate, load, res))
    print("\n".join(summarize(runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
