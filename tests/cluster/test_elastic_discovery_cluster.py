"""``--host-discovery-script`` across namespace hosts over real ssh: a host the script adds
gets an agent and a rank that joins the running world; a host whose ranks keep failing is
excluded for a growing cool-down; fewer than --min-np ranks past --elastic-timeout ends the job
with a message naming what is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import _jobs_at_once as jobs_at_once
from _elastic_grow import EXPECTED, JOB, fields, job_command, script
from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = 3


def _hosts(cluster: tc.Cluster, n: int) -> str:
    return "".join(f"{h.name}:1\\n" for h in cluster.hosts[:n])


def _start(
    cluster: tc.Cluster, tmp: Path, flags: list[str], **env_vars: str
) -> subprocess.Popen[str]:
    """``run_job``'s job, started, with its stdout and stderr going to files in ``tmp``."""
    launcher = ["--ssh-config-file", str(cluster.ssh_config_path)]
    argv, env = job_command(tmp, flags, launcher, **env_vars)
    return jobs_at_once.start(argv, tmp, env)


@pytest.fixture(scope="module")
def jobs(
    cluster: tc.Cluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """The jobs of the first three tests, run at once (each a world with its own ports and its
    own discovery script): a host added, a host whose ranks keep failing, a rank lost below
    --min-np. Each one's code and output by name."""
    h2, h3 = _hosts(cluster, 2), _hosts(cluster, 3)
    grow = ["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script"]
    below = ["-np", "3", "--min-np", "3", "--host-discovery-script"]
    fail = {"HOLD_AT": "4", "HOLD_FOR_LINES": "2", "FAIL_HOST": cluster.hosts[2].name}
    # name: the hosts the script offers before and after the signal, flags after the script's
    # path, the job's variables
    specs: dict[str, tuple[str, str, list[str], list[str], dict[str, str]]] = {
        # HOLD_AT=6: 24 samples processed, the 36 left split evenly over 3 ranks
        "grow": (h2, h3, grow, [], {"HOLD_AT": "6"}),
        "failing": (h3, h3, grow, ["--blacklist-cooldown-range", "1", "8"], fail),
        "below": (h3, h3, below, ["--elastic-timeout", "5"], {"VICTIM": "1"}),
    }
    folders = {name: tmp_path_factory.mktemp(name) for name in specs}
    with jobs_at_once.starting() as procs:
        for name, (before, after, flags, more, env_vars) in specs.items():
            disc = script(folders[name], before, after)
            procs[name] = _start(cluster, folders[name], [*flags, disc, *more], **env_vars)
    return jobs_at_once.finish(procs, folders, 400)


@pytest.mark.timeout(420)
def test_a_host_added_by_the_script_joins_and_the_world_grows(
    cluster: tc.Cluster, jobs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    proc = jobs["grow"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = {s["id"]: s for s in fields(proc.stdout, "start")}
    new_host = cluster.hosts[2].name
    assert starts["2"]["host"] == new_host and starts["2"]["size"] == "3"
    assert {starts["0"]["host"], starts["1"]["host"]} == {h.name for h in cluster.hosts[:2]}
    done = fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1", "2"]
    for d in done:
        assert d["pid"] == starts[d["id"]]["pid"]  # the first two kept their processes
        assert d["size"] == "3" and d["w"] == EXPECTED
    assert f"host {new_host} offers 1 free slot(s): starting rank(s) [2] to join" in proc.stderr
    assert "growing the world to 3 rank(s) [0, 1, 2] (generation 1)" in proc.stderr


@pytest.mark.timeout(420)
def test_a_host_whose_ranks_keep_failing_is_excluded(
    cluster: tc.Cluster, jobs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    bad = cluster.hosts[2].name
    proc = jobs["failing"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spans = [
        float(s)
        for s in re.findall(
            rf"excluding host {bad} for ([\d.]+) s after failure \d of its ranks", proc.stderr
        )
    ]
    assert len(spans) >= 2 and spans[1] > spans[0], proc.stderr
    done = fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1"]
    assert all(d["w"] == EXPECTED and d["size"] == "2" for d in done)


@pytest.mark.timeout(420)
def test_below_min_np_past_the_elastic_timeout_ends_the_job(
    cluster: tc.Cluster, jobs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    proc = jobs["below"]
    h = [x.name for x in cluster.hosts]
    assert proc.returncode == 137, proc.stdout + proc.stderr
    assert (
        f"fewer than --min-np 3 ranks for 5 s (--elastic-timeout): 2 remain "
        f"(rank(s) 0 on {h[0]}, 2 on {h[2]}), 1 more needed"
    ) in proc.stderr
    assert re.search(rf"left: rank 1 \(host {h[1]}, pid \d+\) was killed by SIGKILL", proc.stderr)
    assert f"excluded hosts: {h[1]} (for good)" in proc.stderr
    assert "[0] done" not in proc.stdout


@pytest.mark.timeout(420)
def test_an_unreachable_host_is_excluded_with_ssh_s_reason(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    """The script offers an address on the cluster's subnet that no host has: the agent's ssh
    fails, the host is excluded in one line quoting ssh, and the job goes on without it. The
    ranks hold at a commit until the test has seen that line."""
    ghost = cluster.launcher_address.rsplit(".", 1)[0] + ".200"
    disc = script(tmp_path, _hosts(cluster, 2) + f"{ghost}:1\\n", _hosts(cluster, 2))
    fails = tmp_path / "fails"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MODE": "optimizer",
        "SIGNAL_FILE": str(tmp_path / "unused"),
        "FAILS_FILE": str(fails),
        "HOLD_AT": "4",
        "HOLD_FOR_LINES": "1",
    }
    forward = [
        a
        for n in ["OMP_NUM_THREADS", "MODE", "FAILS_FILE", "HOLD_AT", "HOLD_FOR_LINES"]
        for a in ("-x", n)
    ]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            "--ssh-config-file",
            str(cluster.ssh_config_path),
            "--ssh-connect-timeout",
            "3",
            "-np",
            "2",
            "--min-np",
            "2",
            "--max-np",
            "3",
            "--host-discovery-script",
            disc,
            *forward,
            "--",
            sys.executable,
            str(JOB),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    err: list[str] = []

    def read_err() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)
            if f"excluding host {ghost}" in line:
                fails.write_text("seen\n")  # releases the ranks' hold

    # Only the reader thread reads stderr (communicate() would race it for the line), and
    # another thread drains stdout so the job never blocks on a full pipe.
    outs: list[str] = []
    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    drain = threading.Thread(target=lambda: outs.extend(proc.stdout or []), daemon=True)
    drain.start()
    try:
        proc.wait(timeout=360)
    finally:
        proc.kill()
    reader.join(10)
    drain.join(10)
    out = "".join(outs)
    text = "".join(err)
    assert proc.returncode == 0, out + text
    (line,) = [e for e in err if f"excluding host {ghost}" in e]
    assert "for the rest of the job" in line
    assert f"lost the connection to host {ghost}'s agent (ranks 2): ssh: connect to host" in line
    done = fields(out, "done")
    assert sorted(d["id"] for d in done) == ["0", "1"]
    assert all(d["w"] == EXPECTED and d["size"] == "2" for d in done)
