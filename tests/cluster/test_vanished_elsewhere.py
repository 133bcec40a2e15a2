"""A rank killed without last words under torchrun, on another machine: its peers there name it.

Two namespace hosts, each running torchrun in a pid namespace of its own, so that a host sees
only its own processes, as separate machines do. Nobody records how a torchrun worker ended
where its peers can read it; a peer on the killed rank's machine sees its process ended and
posts that for it, and the peers on the other machine, which cannot look, name it from that post
(``ringtrain.runtime.departures``). Before, their errors said only what Gloo said. The peer on
the killed rank's machine is named so by the single-host test
(tests/launch/test_failing_rank.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launched import TORCHRUN, clean_env, finish, start

from _only_sshd import wait_for_only_sshd
from ringtrain.testing import cluster as tc

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster]
CLUSTER = 2
JOB = Path(__file__).with_name("vanish_job.py")
# What makes a namespace host a machine of its own for processes: its own pid namespace (and
# a /proc that shows it).
OWN_PIDS = ["unshare", "--pid", "--fork", "--mount-proc"]


def test_a_rank_killed_on_another_machine_is_named(cluster: tc.Cluster, tmp_path: Path) -> None:
    endpoint = f"{cluster.hosts[0].address}:29400"
    argv = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    argv += ["--rdzv-endpoint", endpoint, "--rdzv-id", "vanished-elsewhere"]
    # torchrun's agent stops a failed worker's machine-mates once it sees the failure, at its
    # next check (0.1 s by default): rank 2 must post first. On a loaded 2-core machine that
    # lost 1 race in 24 at 0.1 s; the interval the other torchrun tests use leaves it room.
    argv += ["--monitor-interval", "0.5"]
    argv += ["--max-restarts", "0", str(JOB), str(tmp_path)]
    env = clean_env(OMP_NUM_THREADS="1")
    procs = [start([*OWN_PIDS, *argv], tmp_path, env, cluster, h.name) for h in cluster.hosts]
    done = finish(procs, "torchrun")
    outs = "\n".join(out for _, out in done)
    assert all(rc != 0 for rc, _ in done), outs[-4000:]
    assert (tmp_path / "killed_at").exists(), outs[-4000:]
    said = {r: json.loads((tmp_path / f"error.{r}").read_text()) for r in range(2)}
    # c10d numbers a node's ranks together: rank 3 ran beside rank 2, on the other host.
    [killed_on] = {h.name for h in cluster.hosts} - {said[0][0]}
    killed_at = float((tmp_path / "killed_at").read_text())
    print(
        "ranks 0 and 1 named rank 3", [round(said[r][2] - killed_at, 2) for r in (0, 1)], "s after"
    )
    for rank in (0, 1):
        host, error, _ = said[rank]
        assert host != killed_on, said  # the other machine
        assert error.startswith("PeerFailedError"), error
        assert f"rank 3 (host {killed_on}) ended without a word" in error, error
    wait_for_only_sshd(cluster)
