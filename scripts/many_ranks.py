"""Many ranks on namespace hosts: mixed collectives checked on every rank, nothing left behind.

Issue 38's "a job of 32 ranks (16 on each of 2 namespace hosts, tiny ops) starts, runs 1,000
mixed collectives and ends cleanly". Each rank repeats ``--iters`` times: a named 8-element
allreduce (a cached request: vector rounds), an unnamed 16 KiB allreduce (a new name every
time: gathered rounds), a named allgather and a broadcast from a rotating root, and checks every
result. Prints each rank's line (ok, seconds, rounds, vector rounds), the exit code, and what is
left on the hosts afterwards. Needs root (network namespaces). Run::

    .venv/bin/python scripts/many_ranks.py --hosts 2 --per-host 16 --iters 250
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ringtrain.testing import cluster as tc

JOB = textwrap.dedent(
    """
    import sys, time
    import torch
    import ringtrain as rt
    from ringtrain.collectives.ops import controller_of

    iters = int(sys.argv[1])
    rt.init()
    r, n = rt.rank(), rt.size()
    t0, ok = time.monotonic(), True
    for i in range(iters):
        a = rt.allreduce(torch.full((8,), float(r)), name="small", op=rt.Sum)
        ok &= bool(a.eq(n * (n - 1) / 2).all())
        b = rt.allreduce(torch.ones(4096) * (i % 3), op=rt.Sum)
        ok &= bool(b.eq(n * (i % 3)).all())
        g = rt.allgather(torch.tensor([r, i]), name="gather")
        ok &= g.view(-1, 2)[:, 0].tolist() == list(range(n))
        c = rt.broadcast(torch.tensor([i + r]), root_rank=i % n, name="bcast")
        ok &= c.item() == i + i % n
    ctl = controller_of(None)
    vector = ctl._vector.channel.rounds if ctl._vector is not None else 0
    took = time.monotonic() - t0
    print(f"rank {r}: ok={ok} ops={4 * iters} {took:.1f}s rounds={ctl.rounds} vector={vector}")
    rt.shutdown()
    """
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=16)
    ap.add_argument("--iters", type=int, default=250)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, tc.Cluster(args.hosts) as c:
        job = Path(d) / "job.py"
        job.write_text(JOB)
        hosts = ",".join(f"{h.name}:{args.per_host}" for h in c.hosts)
        argv = [sys.executable, "-m", "ringtrain", "run", "--ssh-config-file",
                str(c.ssh_config_path), "-p", str(c.port), "-np",
                str(args.hosts * args.per_host), "-H", hosts, "-x", "OMP_NUM_THREADS=1",
                "--start-timeout", "300", "--", sys.executable, str(job), str(args.iters)]  # fmt: skip
        t0 = time.monotonic()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=d)
        lines = [ln for ln in proc.stdout.splitlines() if "ok=" in ln]
        print(f"exit code {proc.returncode} after {time.monotonic() - t0:.1f} s")
        print(f"{len(lines)} ranks reported, {sum('ok=True' in ln for ln in lines)} ok")
        print("\n".join(lines))
        if proc.returncode:
            print(proc.stderr[-3000:])
        left = [
            f"{h.name}: pid {p}" for h in c.hosts for p in c.pids(h.name) if p != c.sshd_pid(h.name)
        ]
        print("left on the hosts:", left or "nothing")
        return 0 if proc.returncode == 0 and not left else 1


if __name__ == "__main__":
    sys.exit(main())
