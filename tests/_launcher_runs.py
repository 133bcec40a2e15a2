"""The end of a ``ringtrain run`` a test started itself: its exit code and error output, and
that no process it started outlives it (a leftover is killed, then reported)."""

from __future__ import annotations

import contextlib
import subprocess
import time

import psutil


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """The launcher's exit code and stderr; past ``timeout`` it and its children are killed
    and the test fails with what it said."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the launcher did not finish:\n{err}") from None
    return proc.returncode, err


def assert_gone(pids: list[int], within: float = 10.0) -> None:
    """Every process of ``pids`` ends within ``within`` seconds (a zombie counts as ended)."""
    deadline = time.monotonic() + within
    alive = pids
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return
        time.sleep(0.05)
    for p in alive:  # never leak them into other tests
        with contextlib.suppress(psutil.Error):
            psutil.Process(p).kill()
    raise AssertionError(f"processes survived the job: {alive}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
