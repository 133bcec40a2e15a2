"""A durable MPIJob preempted: the manifest's mpirun, run on namespace hosts as
tests/deploy/test_execute.py runs it, given SIGTERM as the kubelet gives the launcher pod's
command; the ranks, started by Open MPI's daemons over ssh on the worker hosts, stop at one
step and save it, as the manifest's ``--mca odls_base_sigkill_timeout`` leaves them the time.
And a worker pod's SIGTERM (its node preempted), passed on by ``ringtrain pod-init``."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from _durable_runs import until_started
from ringtrain.checkpoint import manifest
from ringtrain.deploy import manifests
from ringtrain.deploy.spec import JobSpec
from ringtrain.testing.cluster import sshd_path

from .test_execute import mpijob_on_hosts

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300), pytest.mark.xdist_group("deploy")]
JOB = Path(__file__).parents[1] / "checkpoint" / "durable_job.py"
GRACE_S = 10


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (Debian openmpi-bin)")
def test_a_durable_mpijob_given_sigterm_stops_at_a_step_it_saved(
    make_cluster: Any, tmp_path: Path
) -> None:
    ck = tmp_path / "ck"
    (job,) = [d for d in manifests.generate(_spec(tmp_path, ck), "mpijob") if d["kind"] == "MPIJob"]
    pod = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 2 * GRACE_S + manifests.EXIT_SLACK_S
    cluster, launcher, env = mpijob_on_hosts(make_cluster, job, tmp_path)
    assert " --mca odls_base_sigkill_timeout 10 " in " ".join(launcher.argv)
    with _mpirun(cluster, launcher.argv, env) as mpirun:
        mpirun.send_signal(signal.SIGTERM)  # the kubelet's, to the launcher pod's command
        out = mpirun.communicate(timeout=120)[0]
    said = re.search(r"the job stops at step (\d+), saved into", out)
    assert said and "odls_base_sigkill_timeout" not in out, out[-3000:]
    assert [s for s, _ in manifest.committed(str(ck))] == [int(said[1])], out[-3000:]
    assert mpirun.returncode != 0


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (Debian openmpi-bin)")
def test_a_durable_mpijobs_deleted_worker_pod_passes_sigterm_on_to_its_rank(
    make_cluster: Any, tmp_path: Path
) -> None:
    """A worker pod deleted (a preempted node): the kubelet's SIGTERM goes to the container's
    first process alone, here the manifest's ``ringtrain pod-init`` over sshd, run as PID 1 of
    a PID namespace of its own on worker 1's host. It passes the SIGTERM on to the processes of
    its "pod" (sshd's sessions, Open MPI's daemon, rank 1): the job stops at one step, saved,
    and the pod's processes all end within its grace period. (sshd alone, as PID 1, ends on the
    SIGTERM, and its end kills the rank at once: the job stopped with no save, tried by hand.)"""
    ck = tmp_path / "ck"
    (job,) = [d for d in manifests.generate(_spec(tmp_path, ck), "mpijob") if d["kind"] == "MPIJob"]
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    command = worker["containers"][0]["command"]
    assert command == [*manifests.POD_INIT, "/usr/sbin/sshd", "-De"]
    cluster, launcher, env = mpijob_on_hosts(make_cluster, job, tmp_path)
    host = cluster.hosts[2].name  # worker 1's: rank 1
    pod = _pod(cluster, host, command)
    try:
        with _mpirun(cluster, launcher.argv, env) as mpirun:
            init = psutil.Process(pod.pid).children()[0]  # the pod's PID 1, seen from outside
            init.send_signal(signal.SIGTERM)  # the kubelet's
            init.wait(timeout=worker["terminationGracePeriodSeconds"])  # all its processes ended
            code = pod.wait(timeout=30)  # unshare's: its child's, sshd's (stopped by SIGTERM)
            out = mpirun.communicate(timeout=120)[0]
    finally:
        pod.kill()
        pod.wait()
    said = re.search(r"the job stops at step (\d+), saved into", out)
    assert said, out[-3000:]
    assert [s for s, _ in manifest.committed(str(ck))] == [int(said[1])], out[-3000:]
    assert code == 0, code


def _spec(tmp_path: Path, ck: Path) -> JobSpec:
    return JobSpec.from_mapping(
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


def _pod(cluster: Any, host: str, command: list[str]) -> subprocess.Popen[bytes]:
    """``host``'s sshd replaced by the worker container's ``command`` (sshd with the cluster's
    config), its first process PID 1 of a new PID namespace, as in a pod."""
    sshd = psutil.Process(cluster.sshd_pid(host))
    sshd.terminate()
    sshd.wait(30)
    init = [sys.executable, "-m", "ringtrain", *command[1:3]]  # its installed ``ringtrain``
    config = ["-f", str(cluster.workdir / host / "sshd_config")]
    pod = cluster.popen(
        host, ["unshare", "--pid", "--fork", "--kill-child", *init, sshd_path(), *command[4:],
               *config],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    for _ in range(200):  # sshd listens
        if cluster.ssh(host, ["true"], timeout=10).returncode == 0:
            return pod
        time.sleep(0.05)
    pod.kill()
    raise AssertionError(f"sshd under ringtrain pod-init did not start on {host}")


@contextlib.contextmanager
def _mpirun(cluster: Any, argv: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    """The launcher pod's mpirun, once both ranks started; killed on the way out if it runs."""
    mpirun = cluster.popen(
        cluster.hosts[0].name, argv, env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        until_started(mpirun)
        yield mpirun
    finally:
        if mpirun.poll() is None:
            mpirun.kill()
            mpirun.wait()
