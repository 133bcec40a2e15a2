"""Issue 4's "done when" items on the namespace cluster: a remote rank killed by a signal, and
start failures (a wrong ssh port, a command or ringtrain itself missing on one host). The demo
across hosts is in test_same_weights.py.

The launcher runs in the test's (root) namespace and reaches hosts ``h0`` and ``h1`` through
the cluster's ssh config; the port is given explicitly with ``-p``, as a user would.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from _only_sshd import left_on_hosts
from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = 2
PY = sys.executable
START_TIMEOUT_S = 20.0


def _run_argv(cluster: tc.Cluster, *flags: str, port: int | None = None) -> list[str]:
    """``ringtrain run`` on h0 and h1 over ssh, with the port given by ``-p``."""
    return [
        PY,
        "-m",
        "ringtrain",
        "run",
        "--ssh-config-file",
        str(cluster.ssh_config_path),
        "-p",
        str(cluster.port if port is None else port),
        *flags,
    ]


def _leftovers(cluster: tc.Cluster, marker: str) -> list[str]:
    """Processes of a finished job: anything but sshd in a host, or a local process (an ssh
    client, a rank) whose command line mentions ``marker`` or the cluster's ssh config."""
    left = [f"{host}: pids {pids}" for host, pids in left_on_hosts(cluster).items()]
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or ())
        if p.info["pid"] != psutil.Process().pid and (
            marker in cmd or str(cluster.ssh_config_path) in cmd
        ):
            left.append(f"local: pid {p.info['pid']} {cmd[:120]}")
    return left


def _assert_nothing_left(cluster: tc.Cluster, marker: str, within: float) -> None:
    deadline = time.monotonic() + within
    while left := _leftovers(cluster, marker):
        assert time.monotonic() < deadline, left
        time.sleep(0.05)


# ---- a remote rank killed by SIGKILL -------------------------------------------------------------

SELF_KILL = textwrap.dedent(
    """
    import os, pathlib, signal, subprocess, sys, time
    rank = int(os.environ["RINGTRAIN_RANK"])
    if rank == 2:  # a worker that left its rank's session: found through the process tree
        subprocess.Popen(["sleep", "300"], start_new_session=True)
    pathlib.Path(f"up.{rank}").touch()  # the hosts share this directory
    if rank == 3:
        deadline = time.monotonic() + 60
        while not all(pathlib.Path(f"up.{r}").exists() for r in range(4)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        print("dying at", time.time(), flush=True)  # the hosts share the clock
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)
    """
)


def test_remote_rank_killed_by_sigkill_ends_the_job(cluster: tc.Cluster, tmp_path: Path) -> None:
    script = tmp_path / "self_kill.py"
    script.write_text(SELF_KILL)
    proc = subprocess.Popen(
        [*_run_argv(cluster, "-np", "4", "-H", "h0:2,h1:2", "--"), PY, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("[3] dying at "):
                killed = float(line.split()[-1])
                break
        else:
            raise AssertionError(f"rank 3 never got to die: {proc.communicate()[1]}")
        err = proc.communicate(timeout=30)[1]
        took = time.time() - killed
    finally:
        proc.kill()
        proc.wait()
    assert took < 10, f"the job ended {took:.1f} s after rank 3 died"
    assert proc.returncode == 128 + 9, err
    assert "job failed: rank 3 (host h1, pid " in err and "was killed by SIGKILL" in err, err
    assert "Traceback" not in err
    # Nothing of the job is left anywhere, the sleep that left rank 2's session included.
    _assert_nothing_left(cluster, str(tmp_path), within=2.0)


# ---- start failures: a clear error within --start-timeout, naming the host ---------------------


def _start_failure(cluster: tc.Cluster, tmp_path: Path, port: int, command: str) -> tuple[str, int]:
    t0 = time.monotonic()
    proc = subprocess.run(
        _run_argv(
            cluster,
            "--start-timeout",
            str(START_TIMEOUT_S),
            "-H",
            "h0:1,h1:1",
            "--",
            command,
            port=port,
        ),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert time.monotonic() - t0 < START_TIMEOUT_S
    assert "Traceback" not in proc.stderr, proc.stderr
    _assert_nothing_left(cluster, str(tmp_path), within=2.0)
    return proc.stderr, proc.returncode


def test_wrong_ssh_port_names_the_host(cluster: tc.Cluster, tmp_path: Path) -> None:
    wrong = cluster.port + 1  # nothing listens there
    err, code = _start_failure(cluster, tmp_path, wrong, "true")
    assert code != 0
    assert "the agent on host h0" in err or "the agent on host h1" in err, err
    assert f"port {wrong}: Connection refused" in err, err
    assert "HINT:" in err


@contextlib.contextmanager
def _missing_on(cluster: tc.Cluster, host: str, path: Path) -> Iterator[None]:
    """``path`` looks empty on ``host`` only: an empty tmpfs over it in the mount namespace of
    that host's sshd (``ip netns exec`` gave it its own), which every ssh session inherits."""
    if shutil.which("nsenter") is None:
        pytest.skip("needs nsenter (util-linux) to hide a path on one host")
    enter = ["nsenter", "-t", str(cluster.sshd_pid(host)), "-m"]
    subprocess.run(
        [*enter, "mount", "-t", "tmpfs", "-o", "size=1m", "rtmissing", str(path)], check=True
    )
    try:
        yield
    finally:
        subprocess.run([*enter, "umount", str(path)], check=True)


def test_command_missing_on_one_host_names_that_host(cluster: tc.Cluster, tmp_path: Path) -> None:
    tool = tmp_path / "bin" / "tool"
    tool.parent.mkdir()
    tool.write_text("#!/bin/sh\necho tool ran\n")
    tool.chmod(0o755)
    with _missing_on(cluster, "h1", tool.parent):  # h0 has it, h1 does not
        err, code = _start_failure(cluster, tmp_path, cluster.port, str(tool))
    assert code == 127, err
    assert f"rank 1 (host h1) could not start: cannot start {str(tool)!r}: command not found" in err
    assert "host h0" not in err


def test_ringtrain_missing_on_one_host_names_that_host(cluster: tc.Cluster, tmp_path: Path) -> None:
    # The agent runs the launcher's interpreter; on h1 that path (the virtualenv) is empty.
    venv = Path(sys.prefix)
    if venv == Path(sys.base_prefix):
        pytest.skip("needs a virtualenv to hide from one host")
    with _missing_on(cluster, "h1", venv):
        err, code = _start_failure(cluster, tmp_path, cluster.port, "true")
    assert code != 0
    assert "the agent on host h1 exited before it started" in err, err
    assert f"{PY}: No such file or directory" in err or "not found" in err, err
    assert "ringtrain is installed at the same path on every host" in err
