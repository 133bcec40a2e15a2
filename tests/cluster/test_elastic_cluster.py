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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0"])
def test_survivors_on_other_hosts_resume(cluster: tc.Cluster, victim: int) -> None:
    env = {**os.environ, "VICTIM": str(victim), "MODE": "optimizer", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            *cluster.launcher_args(slots=1),
            "-np",
            "3",
            "--min-np",
            "2",
            "--elastic-timeout",
            "60",
            "-x",
            "VICTIM",
            "-x",
            "MODE",
            "-x",
            "OMP_NUM_THREADS",
            "--",
            sys.executable,
            str(JOB),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
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
