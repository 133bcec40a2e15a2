"""``ringtrain run`` at 16 namespace hosts x 4 torch-free ranks (issue 37 item 6): every rank
starts, one fails, the report names it first, and nothing is left on any host.

The ranks import nothing but the standard library, so what is measured is the launcher's own
cost: one ssh connection and one agent per host, every rank's output relayed through its
host's agent, a rendezvous store. Figures are printed (run with ``-s``), and docs/launch.md
states the bound with them; the bounds asserted here are generous, for a loaded 2-core
machine, and guard against a launcher whose cost per host grows out of hand.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _only_sshd import wait_for_only_sshd
from ringtrain.testing import cluster as tc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
CLUSTER = 16
SLOTS = 4
NP = CLUSTER * SLOTS
VICTIM = 37  # on h9
PY = sys.executable
# The bound for the whole job at 16 hosts: start, fail, report, clean up.
WITHIN_S = 60.0

RANK = textwrap.dedent(
    f"""
    import os, socket, sys, time
    rank, out = int(os.environ["RINGTRAIN_RANK"]), sys.argv[1]
    open(os.path.join(out, f"up.{{rank}}"), "w").close()
    print(f"rank {{rank}} up on {{socket.gethostname()}}", flush=True)
    if rank == {VICTIM}:
        deadline = time.monotonic() + 90
        while len([n for n in os.listdir(out) if n.startswith("up.")]) < {NP}:
            if time.monotonic() > deadline:
                sys.exit(99)
            time.sleep(0.05)
        open(os.path.join(out, "failed_at"), "w").write(repr(time.time()))
        print("rank {VICTIM} gives up: the data is bad", file=sys.stderr, flush=True)
        sys.exit(7)
    time.sleep(120)
    """
)


def test_sixteen_hosts_start_fail_report_and_leave_nothing(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()
    argv = [PY, "-m", "ringtrain", "run", *cluster.launcher_args(slots=SLOTS)]
    argv += ["--", PY, str(script), str(out)]
    began = time.time()
    proc = subprocess.run(
        argv, capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ), timeout=150
    )
    ended = time.time()
    gone_s = wait_for_only_sshd(cluster, within=15.0)
    assert proc.returncode == 7, proc.stdout[-2000:] + proc.stderr[-4000:]
    ups = sorted(out.glob("up.*"), key=lambda p: p.stat().st_mtime)
    assert len(ups) == NP
    started_s = ups[-1].stat().st_mtime - began
    failed_at = float((out / "failed_at").read_text())
    # Every rank's line came back through its host's agent, in one stream.
    assert len([line for line in proc.stdout.splitlines() if " up on h" in line]) == NP
    # The root cause first: the failing rank, its host, its code, its last words.
    report = proc.stderr[proc.stderr.index("ringtrain run: job failed") :]
    first = report.splitlines()[0]
    assert f"rank {VICTIM} (host h9" in first and "exited with code 7" in first, report
    assert f"rank {VICTIM} gives up: the data is bad" in report
    print(
        f"\n{CLUSTER} hosts x {SLOTS} ranks: all started {started_s:.1f} s after the launch; "
        f"the job ended {ended - failed_at:.1f} s after rank {VICTIM} failed; "
        f"{ended - began:.1f} s in all; hosts clean {gone_s:.1f} s later"
    )
    assert ended - began < WITHIN_S
