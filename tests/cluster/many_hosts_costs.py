"""What ``ringtrain run`` costs per host: the job of tests/cluster/test_many_hosts.py (4
torch-free ranks a host, the last rank fails once all are up) at 1, 4, 8 and 16 namespace hosts,
without and with 2,000 output lines per rank. Not a test (it takes a minute): run as root,

    python tests/cluster/many_hosts_costs.py

One JSON line per run: when the last rank started, how long after the failure the launcher
exited, the launcher's own CPU time, threads and ssh clients, and the lines it relayed.
docs/launch.md quotes its figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from ringtrain.testing import cluster as tc

sys.path.insert(0, str(Path(__file__).parent))
import test_many_hosts as job  # the test's rank program, at other sizes


def _rank_program(np: int, lines: int) -> str:
    text = job.RANK.replace(f"== {job.VICTIM}", f"== {np - 1}").replace(f"< {job.NP}", f"< {np}")
    chatter = f'[print(f"rank {{rank}} line {{i}}") for i in range({lines})]\n'
    return text.replace('print(f"rank {rank} up', chatter + 'print(f"rank {rank} up', 1)


def run(hosts: int, lines: int) -> dict[str, Any]:
    with tc.Cluster(hosts) as c, tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        out = d / "out"
        out.mkdir()
        (d / "rank.py").write_text(_rank_program(hosts * job.SLOTS, lines))
        argv = [sys.executable, "-m", "ringtrain", "run", *c.launcher_args(slots=job.SLOTS)]
        argv += ["--", sys.executable, str(d / "rank.py"), str(out)]
        began = time.time()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        launcher = psutil.Process(proc.pid)
        got: dict[str, tuple[str, str]] = {}
        reader = threading.Thread(target=lambda: got.update(io=proc.communicate()))
        reader.start()
        threads = ssh = 0
        cpu = 0.0
        while proc.poll() is None:
            try:
                threads = max(threads, launcher.num_threads())
                ssh = max(ssh, sum(k.name() == "ssh" for k in launcher.children()))
                t = launcher.cpu_times()
                cpu = t.user + t.system
            except psutil.Error:
                pass
            time.sleep(0.05)
        reader.join()
        ended = time.time()
        assert proc.returncode == 7, got["io"][1][-2000:]
        last_up = max(p.stat().st_mtime for p in out.glob("up.*"))
        failed = float((out / "failed_at").read_text())
        return {
            "hosts": hosts,
            "ranks": hosts * job.SLOTS,
            "lines_per_rank": lines,
            "all_started_s": round(last_up - began, 2),
            "ended_after_failure_s": round(ended - failed, 2),
            "launcher_cpu_s": round(cpu, 2),
            "launcher_threads": threads,
            "ssh_clients": ssh,
            "lines_relayed": len(got["io"][0].splitlines()),
        }


if __name__ == "__main__":
    for n_lines in (0, 2000):
        for n_hosts in (1, 4, 8, 16):
            print(json.dumps(run(n_hosts, n_lines)), flush=True)
