"""Elastic recovery across namespace hosts over real ssh: one rank per host, one SIGKILLed
mid-epoch; the other two hosts' ranks re-form the world in the same processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = 3
JOB = Path(__file__).parent.parent / "elastic" / "elastic_job.py"
N, EPOCHS = 60, 2  # as in elastic_job.py
EXPECTED = [N * EPOCHS, EPOCHS * N * (N + 1) // 2, EPOCHS * N * (N + 1) * (2 * N + 1) // 6]


def _fields(out: str, kind: str) -> list[dict[str, str]]:
    return [
        dict(re.findall(r"(\w+)=(\S+)", line))
        for line in out.splitlines()
        if re.match(rf"\[\d+\] {kind} ", line)
    ]


def _job(
    cluster: tc.Cluster, slots: int, min_np: int, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MODE": "optimizer", "OMP_NUM_THREADS": "1", **env_vars}
    forward = [a for name in ["MODE", "OMP_NUM_THREADS", *env_vars] for a in ("-x", name)]
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            *cluster.launcher_args(slots=slots),
            "-np",
            str(3 * slots),
            "--min-np",
            str(min_np),
            "--elastic-timeout",
            "60",
            *forward,
            "--",
            sys.executable,
            str(JOB),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0"])
def test_survivors_on_other_hosts_resume(cluster: tc.Cluster, victim: int) -> None:
    proc = _job(cluster, 1, 2, VICTIM=str(victim))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = {s["id"]: s["pid"] for s in _fields(proc.stdout, "start")}
    done = _fields(proc.stdout, "done")
    survivors = sorted({"0", "1", "2"} - {str(victim)})
    assert sorted(d["id"] for d in done) == survivors
    for d in done:
        assert d["pid"] == pids[d["id"]] and d["size"] == "2"
        assert d["w"] == str(EXPECTED).replace(" ", "")
    (kill,) = _fields(proc.stdout, "kill")
    resets = _fields(proc.stdout, "reset")
    assert len(resets) == 2
    assert max(float(r["t"]) for r in resets) - float(kill["t"]) < 10.0


@pytest.mark.timeout(300)
def test_a_lost_host_drops_all_its_ranks_at_once(cluster: tc.Cluster) -> None:
    """Rank 4 SIGKILLs its agent: host 3's two ranks vanish together (as with a lost host)."""
    proc = _job(cluster, 2, 4, VICTIM="4", KILL="agent", KILL_AT="3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = {s["id"]: s["pid"] for s in _fields(proc.stdout, "start")}
    done = _fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1", "2", "3"]
    for d in done:
        assert d["pid"] == pids[d["id"]] and d["size"] == "4"
        assert d["w"] == str(EXPECTED).replace(" ", "")
    assert "re-forming the world with the 4 remaining rank(s) [0, 1, 2, 3] (generation 1)" in (
        proc.stderr
    )
