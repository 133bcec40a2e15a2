"""Real ``torchrun`` starts ringtrain jobs: one host, and two namespace hosts with c10d rendezvous.

Nothing is exported by hand: torchrun's own variables (RANK, WORLD_SIZE, MASTER_ADDR, the agent's
store) are all ringtrain reads. The training script is tests/cluster/launcher_job.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ringtrain.testing import cluster as tc
from ringtrain.testing.cluster import DOCKER0, HostSpec

pytestmark = pytest.mark.timeout(300)  # above the jobs' own limit, so a hang is reported
# h1 names its interface eth7, and both hosts carry the unrouted docker0 trap.
CLUSTER = [HostSpec(extra=(DOCKER0,)), HostSpec(interface="eth7", extra=(DOCKER0,))]
JOB = Path(__file__).with_name("launcher_job.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LIMIT = 200.0


def _env() -> dict[str, str]:
    """This process's environment without anything that could hand ranks a rendezvous."""
    drop = ("MASTER_", "RINGTRAIN_", "GLOO_", "OMPI_", "PMIX_", "RANK", "WORLD_SIZE", "LOCAL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {k: v for k, v in env.items() if not k.startswith(("TORCHELASTIC_", "PET_"))}


def _results(out: str) -> list[dict[str, Any]]:
    found = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines() if "RESULT " in ln]
    return sorted(found, key=lambda r: r["rank"])


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    """Wait for every torchrun; on timeout stop them all (their workers with them) and fail."""
    done: list[tuple[int, str]] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=LIMIT)
            done.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # each in its own session with its workers
        outs = [p.communicate()[0][-3000:] for p in procs]
        raise AssertionError(f"torchrun did not finish in {LIMIT}s:\n" + "\n".join(outs)) from None
    return done


def test_torchrun_on_one_host(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(JOB)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env=_env(),
        start_new_session=True,
    )
    [(rc, out)] = _finish([proc])
    assert rc == 0, out[-4000:]
    res = _results(out)
    assert [r["rank"] for r in res] == [0, 1], out[-4000:]
    for r in res:
        assert r["launcher"] == "torchrun"
        assert (r["size"], r["local_rank"], r["local_size"]) == (2, r["rank"], 2)
        assert (r["cross_rank"], r["cross_size"]) == (0, 1)
        assert r["identical"] and r["trained"]


@pytest.mark.cluster
def test_torchrun_two_hosts_with_c10d_rendezvous(cluster: tc.Cluster, tmp_path: Path) -> None:
    endpoint = f"{cluster.hosts[0].address}:29400"  # each host has its own port space
    procs = [
        cluster.popen(
            h.name,
            [
                TORCHRUN,
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "launchers-test",
                "--max-restarts",
                "0",
                str(JOB),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=_env(),
            start_new_session=True,
        )
        for h in cluster.hosts
    ]
    done = _finish(procs)
    outs = "\n".join(out for _, out in done)
    assert [rc for rc, _ in done] == [0, 0], outs[-4000:]
    res = _results(outs)
    assert [r["rank"] for r in res] == [0, 1, 2, 3], outs[-4000:]
    # c10d numbers the nodes in the order they join: either host may hold ranks 0-1.
    hosts = [r["host"] for r in res]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]
    assert set(hosts) == {"h0", "h1"}
    for r in res:
        assert r["launcher"] == "torchrun"
        assert (r["size"], r["local_rank"], r["local_size"]) == (4, r["rank"] % 2, 2)
        assert (r["cross_rank"], r["cross_size"]) == (r["rank"] // 2, 2)
        assert r["identical"] and r["trained"]
    assert len({r["checksum"] for r in res}) == 1
    for h in cluster.hosts:
        assert cluster.pids(h.name) == [cluster.sshd_pid(h.name)]
