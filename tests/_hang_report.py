"""Running a job under ``ringtrain run`` from a test, so that a hang says where it hangs.

A job that does not finish in time gets SIGUSR1 in each of its ranks (the job script registers
``faulthandler`` for it: every thread's stack goes to its stderr, which the launcher relays),
then the launcher and every process it started are killed, and the test fails with the tail of
what the job printed. Without this a hang is a bare ``TimeoutExpired`` that names no thread.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence

import psutil
import pytest

TAIL = 12_000  # characters of each stream kept in the failure
# Set in one job's environment, which its launcher, agents and ranks inherit: what is left of that
# job is told from another test's job of the same script running beside it under xdist.
JOB_TAG = "TEST_JOB_TAG"


def tagged(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with a tag of its own, for ``left_behind``."""
    return {**env, JOB_TAG: uuid.uuid4().hex}


def left_behind(env: Mapping[str, str]) -> list[psutil.Process]:
    """The processes still running with the tag of ``env`` (made by ``tagged``)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.pid != psutil.Process().pid and p.environ().get(JOB_TAG) == env[JOB_TAG]:
                found.append(p)
    return found


def run_job(
    cmd: Sequence[str], env: dict[str, str], timeout: float, rank_marker: str
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True)``; past ``timeout`` seconds the
    processes whose command line contains ``rank_marker`` (the ranks) dump their threads."""
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        family = _family(proc.pid)
        for p in family:
            with contextlib.suppress(psutil.Error):
                if any(rank_marker in part for part in p.cmdline()):
                    p.send_signal(signal.SIGUSR1)
        time.sleep(3)  # the dumps travel through the launcher's relay
        for p in [psutil.Process(proc.pid), *family]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"the job did not finish within {timeout:.0f} s; its ranks' threads are in the "
            f"stderr below.\n--- stdout ---\n{out[-TAIL:]}\n--- stderr ---\n{err[-TAIL:]}"
        )
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _family(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []
