"""Real ``mpirun`` (Debian's Open MPI) starts ringtrain jobs with nothing exported by hand.

What a Kubeflow MPIJob launcher pod runs: ``mpirun -np 4 -H h0:2,h1:2 python train.py``. The
only variables set here are the ones that let mpirun itself run in this harness, not ringtrain:
``OMPI_ALLOW_RUN_AS_ROOT``/``_CONFIRM`` (the tests run as root, which mpirun refuses otherwise)
and ``OMPI_MCA_rmaps_base_oversubscribe`` (CI machines may have fewer cores than ranks). The
fake hosts are reached with ``-mca plm_rsh_args "-F <the cluster's ssh config>"``, as a real
cluster's ssh setup would be used. Across hosts, the ranks find rank 0 through MPI (mpi4py);
on one host, from the job id mpirun gives every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from _mpirun import mpirun_env
from _only_sshd import wait_for_only_sshd
from ringtrain.testing import cluster as tc
from ringtrain.testing.cluster import DOCKER0, HostSpec

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (openmpi-bin)"),
    pytest.mark.timeout(300),  # above _run's own limit, so a hung job is stopped and reported
]
# h1 names its interface eth7, and both hosts have the unrouted docker0 (172.17.0.1/16 on each),
# which sorts before eth0/eth7: the rendezvous and Gloo must use eth0/eth7 anyway.
CLUSTER = [HostSpec(extra=(DOCKER0,)), HostSpec(interface="eth7", extra=(DOCKER0,))]
JOB = Path(__file__).with_name("launcher_job.py")


def _results(out: str) -> list[dict[str, Any]]:
    found = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines() if "RESULT " in ln]
    return sorted(found, key=lambda r: r["rank"])


def _run(popen: Any, argv: Sequence[str], timeout: float = 200) -> tuple[int, str]:
    """Run mpirun to the end; on timeout, stop it and its ranks, and fail with its output."""
    proc = popen(argv)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # mpirun stops its ranks and remote daemons on SIGTERM
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: local ranks go too
            out, _ = proc.communicate()
        raise AssertionError(f"mpirun did not finish in {timeout}s:\n{out[-4000:]}") from None
    return proc.returncode, out


def test_mpirun_on_one_host_needs_no_variables(tmp_path: Path) -> None:
    def popen(argv: Sequence[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=mpirun_env(),
            start_new_session=True,
        )

    rc, out = _run(popen, ["mpirun", "-np", "2", sys.executable, str(JOB)])
    assert rc == 0, out[-4000:]
    res = _results(out)
    assert [r["rank"] for r in res] == [0, 1], out[-4000:]
    for r in res:
        assert r["launcher"] == "openmpi"
        assert (r["size"], r["local_rank"], r["local_size"]) == (2, r["rank"], 2)
        assert (r["cross_rank"], r["cross_size"]) == (0, 1)
        assert r["identical"] and r["trained"]
    assert res[0]["checksum"] == res[1]["checksum"]


@pytest.mark.cluster
def test_mpirun_across_two_hosts_needs_no_variables(cluster: tc.Cluster, tmp_path: Path) -> None:
    def popen(argv: Sequence[str]) -> subprocess.Popen[str]:
        # mpirun runs on h0, as on an MPIJob launcher that is also a worker; it reaches h1 by ssh.
        return cluster.popen(
            "h0",
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=mpirun_env(),
            start_new_session=True,
        )

    argv = [
        "mpirun",
        "-mca",
        "plm_rsh_args",
        f"-F {cluster.ssh_config_path}",
        "-np",
        "4",
        "-H",
        "h0:2,h1:2",
        sys.executable,
        str(JOB),
    ]
    rc, out = _run(popen, argv)
    assert rc == 0, out[-4000:]
    res = _results(out)
    assert [r["rank"] for r in res] == [0, 1, 2, 3], out[-4000:]
    for r in res:
        host = r["rank"] // 2
        assert r["launcher"] == "openmpi"
        assert r["host"] == f"h{host}"
        assert (r["size"], r["local_rank"], r["local_size"]) == (4, r["rank"] % 2, 2)
        assert (r["cross_rank"], r["cross_size"]) == (host, 2)
        assert r["identical"] and r["trained"]
    assert len({r["checksum"] for r in res}) == 1
    wait_for_only_sshd(cluster)  # nothing of the job is left on the hosts
