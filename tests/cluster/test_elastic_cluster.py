"""Elastic recovery across namespace hosts over real ssh: one rank per host, one SIGKILLed
mid-epoch; the other two hosts' ranks re-form the world in the same processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import _jobs_at_once as jobs_at_once
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


def _argv(
    cluster: tc.Cluster, slots: int, min_np: int, timeout_s: int, *flags: str, **env_vars: str
) -> tuple[list[str], dict[str, str]]:
    """``elastic_job.py`` on 3 hosts of ``slots`` each, its variables forwarded (``MODE``
    optimizer unless given); the command and its environment."""
    env_vars = {"MODE": "optimizer", "OMP_NUM_THREADS": "1", **env_vars}
    forward = [a for name in env_vars for a in ("-x", name)]
    argv = [
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
        str(timeout_s),
        *flags,
        *forward,
        "--",
        sys.executable,
        str(JOB),
    ]
    return argv, {**os.environ, **env_vars}


def _job(
    cluster: tc.Cluster, folder: Path, slots: int, min_np: int, *flags: str, **env_vars: str
) -> subprocess.CompletedProcess[str]:
    argv, env = _argv(cluster, slots, min_np, 60, *flags, **env_vars)
    proc = jobs_at_once.start(argv, folder, env)
    return jobs_at_once.finish({"job": proc}, {"job": folder}, 240)["job"]


@pytest.fixture(scope="module")
def survivors(
    cluster: tc.Cluster, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """The three one-rank-per-host jobs that lose a rank (rank 1, rank 0, rank 1 with
    --secure), run at once: they share only the hosts, each a world with its own ports."""
    folder = tmp_path_factory.mktemp("survivors")
    jobs = {"rank1": ("1",), "rank0": ("0",), "secure": ("1", "--secure")}
    with jobs_at_once.starting() as procs:
        for name, (victim, *flags) in jobs.items():
            argv, env = _argv(cluster, 1, 2, 60, *flags, VICTIM=victim)
            procs[name] = jobs_at_once.start(argv, folder / name, env)
    return jobs_at_once.finish(procs, {name: folder / name for name in procs}, 240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0"])
def test_survivors_on_other_hosts_resume(
    survivors: dict[str, subprocess.CompletedProcess[str]], victim: int
) -> None:
    proc = survivors[f"rank{victim}"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = {s["id"]: s["pid"] for s in _fields(proc.stdout, "start")}
    done = _fields(proc.stdout, "done")
    survivors_ = sorted({"0", "1", "2"} - {str(victim)})
    assert sorted(d["id"] for d in done) == survivors_
    for d in done:
        assert d["pid"] == pids[d["id"]] and d["size"] == "2"
        assert d["w"] == str(EXPECTED).replace(" ", "")
    (kill,) = _fields(proc.stdout, "kill")
    resets = _fields(proc.stdout, "reset")
    assert len(resets) == 2
    detected = max(float(r["t"]) for r in resets) - float(kill["t"])
    print(f"rank {victim} killed -> survivors re-formed: {detected:.1f} s")
    assert detected < 10.0


@pytest.mark.timeout(300)
def test_secure_survivors_on_other_hosts_resume(
    survivors: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    """--secure across hosts: the survivors authenticate a new rendezvous with the job key they
    hold and make new sealed groups, then finish with the undisturbed result."""
    proc = survivors["secure"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = _fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "2"]
    assert all(d["w"] == str(EXPECTED).replace(" ", "") for d in done)
    resets = _fields(proc.stdout, "reset")
    assert len(resets) == 2 and all(r["backend"] == "ringtrain_sealed" for r in resets), resets


@pytest.mark.timeout(300)
def test_a_lost_host_drops_all_its_ranks_at_once(cluster: tc.Cluster, tmp_path: Path) -> None:
    """Rank 4 SIGKILLs its agent: host 3's two ranks vanish together (as with a lost host)."""
    proc = _job(cluster, tmp_path, 2, 4, VICTIM="4", KILL="agent", KILL_AT="3")
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


def _cut_link_start(cluster: tc.Cluster, mode: str) -> subprocess.Popen[str]:
    # Keepalives every 2 s: the cut host is lost after 6 s of silence instead of 15.
    argv, env = _argv(cluster, 1, 2, 120, "--ssh-keepalive", "2", MODE=mode, VICTIM="2", KILL="cut")
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def _cut_link_jobs(cluster: tc.Cluster, modes: list[str]) -> list[tuple[int, str, str, float]]:
    """One job per mode at once, each with a rank on host h2. h2's ranks stop mid-epoch and,
    once all have, the test takes h2's link down (``ip link set down`` in its namespace):
    nothing exits and nothing closes, the host just falls silent. Both jobs wait out the same
    ssh keepalives together. Returns each job's code, stdout and stderr, and when the link was
    cut."""
    victim = cluster.hosts[2]
    procs = [_cut_link_start(cluster, mode) for mode in modes]
    # Threads read each job's output to its end, so no job fills a pipe while another is
    # awaited; the stopped rank's line sets its job's event.
    outs: list[list[str]] = [[] for _ in procs]
    errs = ["" for _ in procs]
    stopped = [threading.Event() for _ in procs]

    def read_out(i: int) -> None:
        assert procs[i].stdout is not None
        for line in procs[i].stdout:
            outs[i].append(line)
            if line.startswith("[2] kill "):
                stopped[i].set()

    def read_err(i: int) -> None:
        assert procs[i].stderr is not None
        errs[i] = procs[i].stderr.read()

    readers = [
        threading.Thread(target=f, args=(i,), daemon=True)
        for i in range(len(procs))
        for f in (read_out, read_err)
    ]
    for t in readers:
        t.start()
    cut_at = 0.0
    try:
        deadline = time.monotonic() + 240
        # Until every job's h2 rank has stopped, or a job ended without it (its output closed).
        while time.monotonic() < deadline and not all(
            e.is_set() or not readers[2 * i].is_alive() for i, e in enumerate(stopped)
        ):
            time.sleep(0.1)
        if all(e.is_set() for e in stopped):
            cluster.exec(victim.name, ["ip", "link", "set", victim.interface, "down"], check=True)
            cut_at = time.time()
        for p in procs:
            p.wait(timeout=240)
        for t in readers:
            t.join(10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        # Back to a clean host for the next test: its link up, the stranded agents and ranks gone.
        cluster.exec(victim.name, ["ip", "link", "set", victim.interface, "up"])
        sshd = cluster.sshd_pid(victim.name)
        for pid in cluster.pids(victim.name):
            if pid != sshd:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    return [(p.returncode, "".join(o), e, cut_at) for p, o, e in zip(procs, outs, errs)]


@pytest.mark.timeout(400)
def test_a_host_whose_link_is_cut_is_dropped(cluster: tc.Cluster) -> None:
    """The survivors leave the collective that waits on the silent host (no hang), the launcher
    drops the host once ssh's keepalives give up on it, and the two others finish in place; in
    both gradient modes (DistributedOptimizer and allreduce), one job each, run at once."""
    modes = ["optimizer", "allreduce"]
    for mode, (code, out, err, cut_at) in zip(modes, _cut_link_jobs(cluster, modes)):
        assert code == 0 and cut_at > 0, f"{mode}:\n{out}{err}"
        pids = {s["id"]: s["pid"] for s in _fields(out, "start")}
        done = _fields(out, "done")
        assert sorted(d["id"] for d in done) == ["0", "1"], f"{mode}:\n{out}{err}"
        for d in done:
            assert d["pid"] == pids[d["id"]] and d["size"] == "2"
            assert d["w"] == str(EXPECTED).replace(" ", "")
        assert "lost the connection to host h2's agent (ranks 2)" in err, f"{mode}:\n{err}"
        assert "re-forming the world with the 2 remaining rank(s) [0, 1] (generation 1)" in err
        resets = _fields(out, "reset")
        assert len(resets) == 2
        detected = max(float(r["t"]) for r in resets) - cut_at
        print(f"{mode}: link cut -> survivors re-formed: {detected:.1f} s")
        # ssh's keepalives (--ssh-keepalive 2 x ServerAliveCountMax=3) bound detection: well
        # under the transport timeout (300 s) the survivors would otherwise wait.
        assert detected < 120, mode
