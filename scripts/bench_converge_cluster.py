"""``ringtrain bench converge`` on one host and on 2 namespace hosts at several link rates.

One rank per host, one torch thread each (OMP_NUM_THREADS=1). The one-host reference is
``-np 1`` in a namespace host of its own (no link to cross); each pair is a fresh 2-host cluster
whose h0 link is shaped with ``tc tbf`` to the rate (both directions). Every run writes its JSON
next to the others in ``--out``; the summary table (time to target relative to one host) is
printed at the end. Needs root (network namespaces). Run::

    .venv/bin/python scripts/bench_converge_cluster.py --task digits --rates 10mbit,100mbit,1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ringtrain.testing import cluster as tc

PY = sys.executable


def _run(c: tc.Cluster, hosts: str, np: int, out: Path, extra: list[str], timeout: float) -> Any:
    argv = [PY, "-m", "ringtrain", "run", "--ssh-config-file", str(c.ssh_config_path)]
    argv += ["-H", hosts, "-np", str(np), "--start-timeout", "60", "-x", "OMP_NUM_THREADS=1"]
    argv += ["--", PY, "-m", "ringtrain.bench", "converge", "--threads", "1"]
    argv += ["--json", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr, flush=True)
        return None
    return json.loads(out.read_text())["result"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--task", default="digits")
    ap.add_argument("--rates", default="10mbit,100mbit,1gbit")
    ap.add_argument("--out", default="/tmp/ringtrain-converge")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("extra", nargs="*", help="more `bench converge` flags (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--task", args.task, *args.extra]
    results: dict[str, Any] = {}
    with tc.Cluster(1) as c:
        results["one host"] = _run(c, "h0:1", 1, out / "one.json", extra, args.timeout)
    for rate in [r for r in args.rates.split(",") if r]:
        with tc.Cluster([tc.HostSpec(rate=rate), tc.HostSpec()]) as c:
            results[rate] = _run(c, "h0:1,h1:1", 2, out / f"{rate}.json", extra, args.timeout)
    one = results["one host"]
    base = one["runs"][0]["seconds"] if one and one["runs"][0]["reached"] else None
    print("setting | variant | reached | seconds | vs one host | steps | quality | tx B/sample")
    for name, res in results.items():
        for r in (res or {}).get("runs", []):
            ratio = f"{r['seconds'] / base:.2f}x" if base and r["reached"] else "-"
            print(
                f"{name} | {r['variant'] if name != 'one host' else '-'} | {r['reached']} | "
                f"{r['seconds']:.1f} | {ratio} | {r['steps']} | {r['quality']:.4f} | "
                f"{r['tx_bytes_per_sample']:,.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
