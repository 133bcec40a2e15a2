"""Two namespace hosts with one hostname are two hosts (issue 27): cloned VMs and containers
often share a hostname, and grouping ranks by it gave ``cross_size`` 1 and a wrong hierarchy.

Both hosts run as ``box``. Under real torchrun (2 ranks per host) the launcher's node numbers
say which ranks share a host; started by hand with only RANK/WORLD_SIZE/MASTER_ADDR (no node
from any launcher), the address each rank reaches the rendezvous from tells the hosts apart.
The training script is tests/cluster/launcher_job.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from _launched import JOB, TORCHRUN, clean_env, finish_ok, start

from ringtrain.testing import cluster as tc
from ringtrain.testing.netns import ETC_NETNS

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]
CLUSTER = 2
SAME = ["sh", "-c", 'hostname box && exec "$@"', "sh"]  # inside the host's own UTS namespace


@pytest.fixture(scope="module", autouse=True)
def _box_resolves_to_each_host(cluster: tc.Cluster) -> None:
    """Inside each host, ``box`` names that host itself, as a machine's own hostname does
    (torchrun and Gloo resolve it); the cluster removes these files when it goes down."""
    for h in cluster.hosts:
        with open(ETC_NETNS / h.netns / "hosts", "a") as f:
            f.write(f"{h.address} box\n")


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
        start([*SAME, *argv, str(JOB)], tmp_path, clean_env(), cluster, h.name)
        for h in cluster.hosts
    ]
    res = finish_ok(procs, "the job")
    _check(res)
    assert {r["launcher"] for r in res} == {"torchrun"}
    assert {r["ringtrain_host"] for r in res} == {"box[GROUP_RANK=0]", "box[GROUP_RANK=1]"}


def test_no_launcher_node_then_the_address_tells_hosts_apart(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    master = cluster.hosts[0].address
    procs = [
        start(
            [*SAME, sys.executable, str(JOB)],
            tmp_path,
            clean_env(RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR=master, MASTER_PORT="29401"),
            cluster,
            cluster.hosts[rank // 2].name,
        )
        for rank in range(4)
    ]
    res = finish_ok(procs, "the job")
    _check(res)
    hosts = {h.address for h in cluster.hosts}
    assert {r["ringtrain_host"] for r in res} == {f"box[{a}]" for a in hosts}
