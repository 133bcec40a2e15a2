"""Real ``torchrun`` starts ringtrain jobs: one host, and two namespace hosts with c10d rendezvous.

Nothing is exported by hand: torchrun's own variables (RANK, WORLD_SIZE, MASTER_ADDR, the agent's
store) are all ringtrain reads. The training script is tests/cluster/launcher_job.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launched import JOB, TORCHRUN, clean_env, finish, results, start

from _only_sshd import wait_for_only_sshd
from ringtrain.testing import cluster as tc
from ringtrain.testing.cluster import DOCKER0, HostSpec

pytestmark = pytest.mark.timeout(300)  # above the jobs' own limit, so a hang is reported
# h1 names its interface eth7, and both hosts carry the unrouted docker0 trap.
CLUSTER = [HostSpec(extra=(DOCKER0,)), HostSpec(interface="eth7", extra=(DOCKER0,))]


def test_torchrun_on_one_host(tmp_path: Path) -> None:
    argv = [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(JOB)]
    proc = start(argv, tmp_path, clean_env())
    [(rc, out)] = finish([proc], "torchrun")
    assert rc == 0, out[-4000:]
    res = results(out)
    assert [r["rank"] for r in res] == [0, 1], out[-4000:]
    for r in res:
        assert r["launcher"] == "torchrun"
        assert (r["size"], r["local_rank"], r["local_size"]) == (2, r["rank"], 2)
        assert (r["cross_rank"], r["cross_size"]) == (0, 1)
        assert r["identical"] and r["trained"]


@pytest.mark.cluster
def test_torchrun_two_hosts_with_c10d_rendezvous(cluster: tc.Cluster, tmp_path: Path) -> None:
    endpoint = f"{cluster.hosts[0].address}:29400"  # each host has its own port space
    argv = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", endpoint, "--rdzv-id", "launchers-test", "--max-restarts", "0"]
    procs = [
        start([*argv, str(JOB)], tmp_path, clean_env(), cluster, h.name) for h in cluster.hosts
    ]
    done = finish(procs, "torchrun")
    outs = "\n".join(out for _, out in done)
    assert [rc for rc, _ in done] == [0, 0], outs[-4000:]
    res = results(outs)
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
    wait_for_only_sshd(cluster)  # nothing of the job is left on the hosts
