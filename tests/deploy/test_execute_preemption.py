"""A durable MPIJob preempted: the manifest's mpirun, run on namespace hosts as
tests/deploy/test_execute.py runs it, given SIGTERM as the kubelet gives the launcher pod's
command; the ranks, started by Open MPI's daemons over ssh on the worker hosts, stop at one
step and save it, as the manifest's ``--mca odls_base_sigkill_timeout`` leaves them the time."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ringtrain.checkpoint import manifest
from ringtrain.deploy import manifests
from ringtrain.deploy.spec import JobSpec

from .test_execute import mpijob_on_hosts

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300), pytest.mark.xdist_group("deploy")]
JOB = Path(__file__).parents[1] / "checkpoint" / "durable_job.py"
GRACE_S = 10


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (Debian openmpi-bin)")
def test_a_durable_mpijob_given_sigterm_stops_at_a_step_it_saved(
    make_cluster: Any, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    spec = JobSpec.from_mapping(
        {
            "name": "tiny",
            "image": "local",
            # 1,000 steps of 0.3 s: it ends only by the signal.
            "command": [sys.executable, str(JOB), str(tmp_path / "w.pt"), "1000", "0.3"],
            "replicas": 2,
            "cpus": 1,
            "memory": "1Gi",
            "settings": {
                "timeout_s": 60.0,
                "checkpoint_dir": str(ck),
                "checkpoint_every": "1000",
                "grace_period_s": GRACE_S,
            },
        }
    )
    (job,) = [d for d in manifests.generate(spec, "mpijob") if d["kind"] == "MPIJob"]
    pod = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 2 * GRACE_S + manifests.EXIT_SLACK_S
    cluster, launcher, env = mpijob_on_hosts(make_cluster, job, tmp_path)
    assert " --mca odls_base_sigkill_timeout 10 " in " ".join(launcher.argv)
    mpirun = cluster.popen(
        cluster.hosts[0].name, launcher.argv, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert mpirun.stdout is not None
        started = []
        while len(started) < 2:
            line = mpirun.stdout.readline()
            assert line, "the job ended before its ranks started:\n" + "".join(started)
            started += [line] if " starts at step " in line else []
        mpirun.send_signal(signal.SIGTERM)  # the kubelet's, to the launcher pod's command
        out = mpirun.communicate(timeout=120)[0]
    finally:
        if mpirun.poll() is None:
            mpirun.kill()
            mpirun.wait()
    said = re.search(r"the job stops at step (\d+), saved into", out)
    assert said and "odls_base_sigkill_timeout" not in out, out[-3000:]
    assert [s for s, _ in manifest.committed(str(ck))] == [int(said[1])], out[-3000:]
    assert mpirun.returncode != 0
