"""``ringtrain bench mixed-speed`` with one rank per namespace host, the links shaped to a rate.

Issue 41's setting: hosts joined by a link (``tc tbf`` on every host's link, both directions),
one rank and one torch thread each, one rank slowed by sleeping (``--slow-by sleep``: the hosts
share this machine's cores, so a CPU hog would slow them all); ``-- --slow-by cgroup`` gives
every rank a CPU quota of its own instead, so that 3 hosts fit 2 cores. ``--rounds`` repeats the job,
each time on a fresh cluster; every run's JSON goes to ``--out``. Needs root. Run::

    .venv/bin/python scripts/bench_mixed_speed_cluster.py --hosts 2 --rate 1gbit --rounds 2 -- \\
        --slow-rank 1 --slow-factor 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from ringtrain.testing import cluster as tc

PY = sys.executable


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="/tmp/ringtrain-mixed-speed")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("extra", nargs="*", help="more `bench mixed-speed` flags (after --)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for i in range(args.rounds):
        print(f"== round {i + 1}, {args.hosts} hosts at {args.rate}, load {os.getloadavg()[0]:.1f}")
        specs = [tc.HostSpec(rate=args.rate) for _ in range(args.hosts)]
        with tc.Cluster(specs) as c:
            hosts = ",".join(f"h{k}:1" for k in range(args.hosts))
            argv = [PY, "-m", "ringtrain", "run", "--ssh-config-file", str(c.ssh_config_path)]
            argv += ["-H", hosts, "-np", str(args.hosts), "--start-timeout", "60"]
            argv += ["-x", "OMP_NUM_THREADS=1"]
            if os.environ.get("PYTHONPATH"):  # another copy of src/ on every host
                argv += ["-x", "PYTHONPATH"]
            argv += ["--", PY, "-m", "ringtrain.bench", "mixed-speed", "--threads", "1"]
            argv += ["--slow-by", "sleep", "--json", str(out / f"mixed-{i}.json"), *args.extra]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=args.timeout, env=env
            )
        print(proc.stdout, flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr, flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
