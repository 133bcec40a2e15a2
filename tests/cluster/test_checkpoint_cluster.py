"""Durable checkpoints with ranks on two hosts: one rank on each of the namespace hosts ``h0`` and
``h1`` writes its part into one checkpoint directory (the hosts share this machine's file
system, as hosts share an NFS or Lustre mount), the launcher is killed with ``kill -9``, nothing
is left on either host, and ``ringtrain run --resume`` with the ranks' hosts swapped finishes
with the weights of an uninterrupted run on one host.

What this does not show: a network file system's own semantics (caching, late visibility of a
renamed file); the namespaces see one local file system.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from _durable_runs import wait_for_commit
from _only_sshd import left_on_hosts, wait_for_only_sshd
from ringtrain.checkpoint import manifest
from ringtrain.testing import cluster as tc

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]
CLUSTER = 2
PY = sys.executable
JOB = str(Path(__file__).resolve().parents[1] / "checkpoint" / "durable_job.py")
STEPS = 12


def _argv(hosts: list[str], *flags: str, out: Path, pause: float) -> list[str]:
    return [PY, "-m", "ringtrain", "run", *hosts, "-np", "2", "--checkpoint-every", "2", *flags,
            "--", PY, JOB, str(out), str(STEPS), str(pause)]  # fmt: skip


def _on(cluster: tc.Cluster, order: str) -> list[str]:
    return ["--ssh-config-file", str(cluster.ssh_config_path), "-p", str(cluster.port), "-H", order]


def _run(argv: list[str], cwd: Path) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_a_job_on_two_hosts_killed_then_resumed_swapped_ends_with_one_hosts_weights(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    ck, out = tmp_path / "ck", tmp_path / "two-hosts.pt"
    launcher = subprocess.Popen(
        _argv(_on(cluster, "h0:1,h1:1"), "--checkpoint-dir", str(ck), out=out, pause=0.5),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    ref: subprocess.Popen[bytes] | None = None
    try:
        # The uninterrupted one-host reference runs beside the two-host job (they share nothing).
        # Only its weights count: the thread writer spares each rank a writer process.
        one_host, ref_log = tmp_path / "one-host.pt", tmp_path / "one-host.log"
        ref_flags = ["--checkpoint-dir", str(tmp_path / "ref"), "--checkpoint-writer", "thread"]
        with ref_log.open("w") as log:
            ref = subprocess.Popen(
                _argv([], *ref_flags, out=one_host, pause=0.0),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=tmp_path,
            )
        wait_for_commit(launcher, ck, 4)
        running = set(left_on_hosts(cluster))
        assert running == {"h0", "h1"}, running  # a rank (and its agent) on each host
        family = psutil.Process(launcher.pid).children(recursive=True)  # the ssh clients
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        psutil.wait_procs(family, timeout=60)
        wait_for_only_sshd(cluster, within=60)  # each host's agent sees its ssh session end
        assert ref.wait(timeout=300) == 0, ref_log.read_text()
    finally:
        for p in (launcher, ref):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    saved = max(s for s, _ in manifest.committed(str(ck)))
    assert saved < STEPS and not out.exists()

    said = _run(_argv(_on(cluster, "h1:1,h0:1"), "--resume", str(ck), out=out, pause=0.0), tmp_path)
    assert said.count(f"starts at step {saved}") == 2, said  # both ranks, from the last commit
    want, got = torch.load(one_host), torch.load(out)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert [s for s, _ in manifest.committed(str(ck))] == [8, 10, 12]
    wait_for_only_sshd(cluster)
