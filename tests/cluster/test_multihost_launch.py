"""``ringtrain run`` across namespace hosts over ssh: placement, failures, cleanup, forwarding."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _only_sshd import wait_for_only_sshd
from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = 2
PY = sys.executable

RANK = textwrap.dedent(
    """
    import os, socket, sys, time
    rank = int(os.environ["RINGTRAIN_RANK"])
    print(f"rank {rank} host {socket.gethostname()} local {os.environ['HOROVOD_LOCAL_RANK']} "
          f"cross {os.environ['HOROVOD_CROSS_RANK']} fwd {os.environ.get('MY_SETTING')} "
          f"secret {os.environ.get('MY_SECRET')} kernels {os.environ.get('ATEN_CPU_CAPABILITY')} "
          f"cwd {os.getcwd()}", flush=True)
    if sys.argv[1] == "fail" and rank == 3:
        time.sleep(0.5)
        print("rank 3 gives up", file=sys.stderr, flush=True)
        sys.exit(5)
    if sys.argv[1] in ("fail", "sleep"):
        time.sleep(120)
    """
)


KERNELS = {"ATEN_CPU_CAPABILITY": "default"}


def _launch(cluster: tc.Cluster, tmp_path: Path, mode: str, *flags: str) -> subprocess.Popen[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return subprocess.Popen(
        [
            PY,
            "-m",
            "ringtrain",
            "run",
            *cluster.launcher_args(slots=2),
            *flags,
            "--",
            PY,
            str(script),
            mode,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        # ATen's kernels reach every host unasked (hosts of different CPUs compute alike).
        env={**os.environ, "MY_SETTING": "on", "MY_SECRET": "not-forwarded", **KERNELS},
    )


def test_ranks_are_placed_host_major_with_forwarded_env(
    cluster: tc.Cluster, tmp_path: Path
) -> None:
    proc = _launch(cluster, tmp_path, "ok", "-x", "MY_SETTING")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    lines = sorted(out.splitlines())
    assert lines == [
        f"[0] rank 0 host h0 local 0 cross 0 fwd on secret None kernels default cwd {tmp_path}",
        f"[1] rank 1 host h0 local 1 cross 0 fwd on secret None kernels default cwd {tmp_path}",
        f"[2] rank 2 host h1 local 0 cross 1 fwd on secret None kernels default cwd {tmp_path}",
        f"[3] rank 3 host h1 local 1 cross 1 fwd on secret None kernels default cwd {tmp_path}",
    ]
    wait_for_only_sshd(cluster)


def test_a_remote_failure_ends_the_job_everywhere(cluster: tc.Cluster, tmp_path: Path) -> None:
    proc = _launch(cluster, tmp_path, "fail")
    start = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 5, out + err
    assert "rank 3 (host h1" in err and "exited with code 5" in err
    assert "| rank 3 gives up" in err
    assert time.monotonic() - start < 30
    wait_for_only_sshd(cluster)


def test_killing_the_launcher_stops_remote_ranks(cluster: tc.Cluster, tmp_path: Path) -> None:
    proc = _launch(cluster, tmp_path, "sleep")
    assert proc.stdout is not None
    started = 0
    while started < 4:  # every rank is up
        line = proc.stdout.readline()
        assert line, "launcher ended early"
        started += line.startswith("[")
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    wait_for_only_sshd(cluster, within=10.0, since=killed)  # issue 4: gone within 10 s


def test_unreachable_host_is_named_with_sshs_words(cluster: tc.Cluster, tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    # A host alias that points at a closed port on the cluster's own bridge: fails locally.
    config.write_text(
        Path(cluster.ssh_config_path).read_text()
        + f"\nHost ghost\n  HostName {cluster.launcher_address}\n  Port 1\n"
    )
    proc = subprocess.run(
        [
            PY,
            "-m",
            "ringtrain",
            "run",
            "--ssh-config-file",
            str(config),
            "-H",
            "h0:1,ghost:1",
            "--start-timeout",
            "20",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "the agent on host ghost" in proc.stderr and "Connection refused" in proc.stderr
    assert "Traceback" not in proc.stderr
    wait_for_only_sshd(cluster)
