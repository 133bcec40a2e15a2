"""``ringtrain pod-init``: as PID 1 of a PID namespace (``unshare --pid --fork``, as a container's
first process), it passes SIGTERM on to every process in it, its command's descendants in other
sessions included, and exits once all ended; elsewhere it refuses, saying why."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

INIT = [sys.executable, "-m", "ringtrain", "pod-init", "--"]
needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="runs it as PID 1 of a PID namespace of its own: needs root and unshare",
)


def _in_pid_namespace(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", *INIT, *command],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@needs_namespaces
def test_sigterm_reaches_every_process_of_the_namespace_and_init_waits_for_them(
    tmp_path: Path,
) -> None:
    """The command starts, in a session of its own (as sshd's sessions are), a process that
    takes a second to end on SIGTERM, and itself ends at once on it: init exits only after the
    other did, with the command's exit code."""
    done = tmp_path / "done"
    late = f"trap 'sleep 1; echo saved > {done}; exit 0' TERM; while :; do sleep 0.1; done"
    command = ["sh", "-c", f'trap true TERM; setsid sh -c "{late}" & wait; exit 3']
    unshare = _in_pid_namespace(command)
    try:
        init = None
        while init is None or len(init.children(recursive=True)) < 3:  # sh, setsid sh, sleep
            time.sleep(0.05)
            children = psutil.Process(unshare.pid).children()
            init = children[0] if children else None
            assert unshare.poll() is None, unshare.communicate()
        init.send_signal(signal.SIGTERM)
        assert unshare.wait(timeout=60) == 3, unshare.communicate()
        assert done.read_text() == "saved\n"
    finally:
        if unshare.poll() is None:
            unshare.kill()
            unshare.wait()


@needs_namespaces
def test_without_a_signal_it_ends_with_its_command() -> None:
    unshare = _in_pid_namespace(["sh", "-c", "exit 5"])
    assert unshare.wait(timeout=60) == 5


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ([], "no command given; write the container's command after it"),
        (["true"], "it runs as a container's first process (PID 1)"),
    ],
)
def test_bad_use_is_a_clear_error(command: list[str], said: str) -> None:
    """Outside PID 1 it refuses: its SIGTERM to every process would reach beyond a container."""
    proc = subprocess.run([*INIT, *command], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr


@needs_namespaces
def test_a_command_that_cannot_start_is_a_clear_error() -> None:
    unshare = _in_pid_namespace(["/nonexistent/sshd", "-De"])
    _, err = unshare.communicate(timeout=60)
    assert unshare.returncode == 2 and "cannot start '/nonexistent/sshd'" in err, err
