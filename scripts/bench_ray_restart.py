"""A killed Ray worker: ringtrain's RayExecutor going on in place vs Ray Train's elastic restart.

Both run the same job (tests/ray/ray_job.py, modes ``elastic`` and ``raytrain-restart``) on a
real 2-node Ray cluster in two namespace hosts (``ringtrain.testing.ray_cluster``): 3 workers on
2 hosts, a small ringtrain training loop of 24 steps at 0.1 s each, a commit (or a Ray Train
checkpoint) every 5 steps, and one worker SIGKILLs itself at step 12.

* ``RayExecutor(min_workers=2, max_workers=3)``: the survivors roll back to their last commit and
  go on in the same processes. Measured: the kill to the survivors' first step in the re-formed
  world (the later of the two).
* Ray Train ``TorchTrainer`` with ``RingtrainConfig``, ``num_workers=(2, 3)``,
  ``FailureConfig(max_failures=1)``: Ray Train replaces the group. Measured: the kill to the
  first step of a process started after it.

Each round starts a fresh Ray cluster, runs the in-place job then the restart job (Ray Train's
leftovers are not waited for, so the round's cluster is stopped after it) and prints both with
their ratio. Needs root (network namespaces) and Ray (``pip install 'ringtrain[ray]'``)::

    sudo .venv/bin/python scripts/bench_ray_restart.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ringtrain.testing import cluster as tc
from ringtrain.testing.ray_cluster import RayCluster, RayClusterError

JOB = Path(__file__).resolve().parents[1] / "tests" / "ray" / "ray_job.py"
STEPS, KILL_STEP = 24, 12  # as in ray_job.py


def _job(rc: RayCluster, mode: str, timeout: float) -> dict[str, Any]:
    out_dir = tempfile.mkdtemp(prefix=f"ringtrain-bench-ray-{mode}-")
    done = rc.run_driver("h0", [sys.executable, str(JOB), mode, out_dir], timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{mode} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def in_place(el: dict[str, Any]) -> tuple[float, int, int]:
    """Seconds from the kill to the survivors' next step, processes restarted, steps redone."""
    survivors = el["results"]
    restarted = sum(len({p for *_, p in s["log"]}) - 1 for s in survivors)
    reformed = [next(e for e in s["log"] if e[2] == 2) for s in survivors]
    seconds = max(e[1] for e in reformed) - el["killed"]["time"]
    return seconds, restarted, KILL_STEP - min(e[0] for e in reformed) + 1


def restart(rt: dict[str, Any]) -> tuple[float, int, int]:
    """Seconds from the kill to the first step of a new process, new processes, steps redone."""
    t_kill = rt["killed"]["time"]
    new = [log for log in rt["logs"].values() if log and log[0][1] > t_kill]
    if not new or not all(log[-1][0] == STEPS for log in new):
        raise SystemExit(f"Ray Train's restarted group did not finish: {rt['logs']}")
    seconds = min(log[0][1] for log in new) - t_kill
    return seconds, len(new), KILL_STEP - min(log[0][0] for log in new) + 1


def _start(cluster: tc.Cluster, tries: int = 3) -> RayCluster:
    """A started Ray cluster; on a loaded machine ``ray start`` can time out, so try again."""
    for attempt in range(1, tries + 1):
        try:
            return RayCluster(cluster, num_cpus=2).start()
        except RayClusterError as e:
            if attempt == tries:
                raise
            print(f"ray start failed (try {attempt} of {tries}), again: {str(e)[-300:]}")
    raise AssertionError("unreachable")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the Ray nodes run in network namespaces")
    rows: list[tuple[float, float]] = []
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    with tc.Cluster(2) as cluster:
        for r in range(args.rounds):
            rc = _start(cluster)
            try:
                a, a_restarted, a_redone = in_place(_job(rc, "elastic", args.timeout))
                b, b_new, b_redone = restart(_job(rc, "raytrain-restart", args.timeout))
            finally:
                rc.stop()
            rows.append((a, b))
            print(
                f"round {r + 1}: in place {a:.2f} s ({a_restarted} restarted, {a_redone} redone)"
                f" | Ray Train restart {b:.2f} s ({b_new} new processes, {b_redone} redone)"
                f" | restart / in place {b / a:.1f}x  (load {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    a_s, b_s = [x for x, _ in rows], [y for _, y in rows]
    ratios = [y / x for x, y in rows]
    print(
        f"median of {len(rows)}: in place {statistics.median(a_s):.2f} s "
        f"[{min(a_s):.2f}-{max(a_s):.2f}], Ray Train restart {statistics.median(b_s):.2f} s "
        f"[{min(b_s):.2f}-{max(b_s):.2f}], ratio {statistics.median(ratios):.1f}x "
        f"[{min(ratios):.1f}-{max(ratios):.1f}]"
    )
    return 0


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"({time.monotonic() - started:.0f} s in all)")
    raise SystemExit(code)
