"""Two namespace hosts with one hostname are two hosts (issue 27): cloned VMs and containers
often share a hostname, and grouping ranks by it gave ``cross_size`` 1 and a wrong hierarchy.

Both hosts run as ``box``. Under real torchrun (2 ranks per host) the launcher's node numbers
say which ranks share a host; started by hand with only RANK/WORLD_SIZE/MASTER_ADDR (no node
from any launcher), the address each rank reaches the rendezvous from tells the hosts apart.
The training script is tests/cluster/launcher_job.py.
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
from ringtrain.testing.netns import ETC_NETNS

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]
CLUSTER = 2
JOB = Path(__file__).with_name("launcher_job.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LIMIT = 200.0
SAME = ["sh", "-c", 'hostname box && exec "$@"', "sh"]  # inside the host's own UTS namespace


@pytest.fixture(scope="module", autouse=True)
def _box_resolves_to_each_host(cluster: tc.Cluster) -> None:
    """Inside each host, ``box`` names that host itself, as a machine's own hostname does
    (torchrun and Gloo resolve it); the cluster removes these files when it goes down."""
    for h in cluster.hosts:
        with open(ETC_NETNS / h.netns / "hosts", "a") as f:
            f.write(f"{h.address} box\n")


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that could hand ranks a rendezvous."""
    drop = ("MASTER_", "RINGTRAIN_", "GLOO_", "OMPI_", "PMIX_", "RANK", "WORLD_SIZE", "LOCAL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env = {k: v for k, v in env.items() if not k.startswith(("TORCHELASTIC_", "PET_", "NODE_"))}
    return {**env, **extra}


def _finish(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """Wait for every process; on timeout stop them all and fail. The ranks' RESULT lines."""
    outs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=LIMIT)
            outs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # each in its own session with its children
        tails = [p.communicate()[0][-3000:] for p in procs]
        raise AssertionError(f"the job did not finish in {LIMIT}s:\n" + "\n".join(tails)) from None
    text = "\n".join(outs)
    assert [p.returncode for p in procs] == [0] * len(procs), text[-4000:]
    found = [json.loads(ln.split("RESULT ", 1)[1]) for ln in text.splitlines() if "RESULT " in ln]
    return sorted(found, key=lambda r: r["rank"])


def _check(res: list[dict[str, Any]]) -> None:
    assert [r["rank"] for r in res] == [0, 1, 2, 3], res
    assert {r["host"] for r in res} == {"box"}  # one hostname ...
    for r in res:  # ... two hosts
        assert (r["size"], r["local_rank"], r["local_size"]) == (4, r["rank"] % 2, 2), r
        assert (r["cross_rank"], r["cross_size"]) == (r["rank"] // 2, 2), r
        assert r["identical"] and r["trained"]
    labels = [r["ringtrain_host"] for r in res]
    assert labels[0] == labels[1] != labels[2] == labels[3], labels
    assert all(label.startswith("box[") for label in labels), labels


def test_torchrun_two_hosts_with_one_hostname(cluster: tc.Cluster, tmp_path: Path) -> None:
    endpoint = f"{cluster.hosts[0].address}:29400"
    argv = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", endpoint, "--rdzv-id", "same-hostname", "--max-restarts", "0"]
    procs = [
        cluster.popen(
            h.name,
            [*SAME, *argv, str(JOB)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=_env(),
            start_new_session=True,
        )
        for h in cluster.hosts
    ]
    res = _finish(procs)
    _check(res)
    assert {r["launcher"] for r in res} == {"torchrun"}
    assert {r["ringtrain_host"] for r in res} == {"box[GROUP_RANK=0]", "box[GROUP_RANK=1]"}


def test_no_launcher_node_then_the_address_tells_hosts_apart(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    master = cluster.hosts[0].address
    procs = [
        cluster.popen(
            cluster.hosts[rank // 2].name,
            [*SAME, sys.executable, str(JOB)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=_env(RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR=master, MASTER_PORT="29401"),
            start_new_session=True,
        )
        for rank in range(4)
    ]
    res = _finish(procs)
    _check(res)
    hosts = {h.address for h in cluster.hosts}
    assert {r["ringtrain_host"] for r in res} == {f"box[{a}]" for a in hosts}
