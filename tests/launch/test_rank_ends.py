"""How ranks end under ``ringtrain run``: who is named, which signal they get, what they leave.

- a rank that calls ``sys.exit(3)`` right after ``init()`` while its peers wait in a plain
  ``hvd.allreduce`` is named first with code 3, and the launcher exits 3, although its peers,
  whose collectives its shutdown ended, exit before its own process does;
- a rank that vanishes with ``os._exit(0)`` mid-job, so that its peers fail, is named;
- Ctrl-C reaches the ranks' Python as ``KeyboardInterrupt`` (their ``finally`` blocks run), and
  SIGTERM to the launcher reaches them as SIGTERM, the launcher then exiting 143;
- the processes a rank started are ended when it exits: on success, on a raise, and when the
  rank was SIGKILLed from outside; a child in a session of its own and a forked child that
  ignores SIGTERM included.

Every test runs the real launcher and checks that no process it started is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _launcher_runs import assert_gone, finish

pytestmark = pytest.mark.timeout(240)

HVD_JOB = textwrap.dedent(
    """
    import os, sys, torch
    import ringtrain.torch as hvd
    mode = sys.argv[1]
    hvd.init()
    if mode == "exit3" and hvd.rank() == 1:
        sys.exit(3)
    for step in range(100000):
        if mode == "osexit0" and hvd.rank() == 1 and step == 20:
            os._exit(0)
        hvd.allreduce(torch.ones(2), name="a")
    """
)

# No torch: each rank records its pid, starts what the mode asks, and says it is ready.
PLAIN_JOB = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RINGTRAIN_RANK"])

    def note(name, text=""):
        with open(os.path.join(out, f"{name}.{rank}"), "a") as f:
            f.write(text)

    def on_term(signum, frame):
        note("term", signal.Signals(signum).name)
        sys.exit(0)

    note("pid", str(os.getpid()))
    if mode.startswith("children"):
        kids = [subprocess.Popen(["sleep", "1000"]).pid]
        kids.append(subprocess.Popen(["sleep", "1001"], start_new_session=True).pid)
        pid = os.fork()
        if pid == 0:  # a forked worker that ignores SIGTERM
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(1002)
            os._exit(0)
        kids.append(pid)
        note("kids", " ".join(map(str, kids)))
    if mode == "sigterm":
        signal.signal(signal.SIGTERM, on_term)
    note("ready")
    if mode == "children-ok":
        sys.exit(0)
    if mode == "children-raise" and rank == 1:
        raise RuntimeError("a failure with children alive")
    if mode == "children-killed" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        note("caught", "KeyboardInterrupt")
        raise
    finally:
        note("finally")
    """
)


def _launch(tmp_path: Path, np: int, script: str, *args: str) -> subprocess.Popen[str]:
    path = tmp_path / "job.py"
    path.write_text(script)
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", str(np), "--"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*argv, sys.executable, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_ready(tmp_path: Path, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(tmp_path.glob("ready.*"))) < n:
        assert time.monotonic() < deadline, f"ranks not ready: {list(tmp_path.iterdir())}"
        time.sleep(0.05)


def _pids(tmp_path: Path, name: str) -> list[int]:
    return [int(p) for f in tmp_path.glob(f"{name}.*") for p in f.read_text().split()]


def _report(err: str) -> list[str]:
    return err[err.index("ringtrain run: job failed") :].splitlines()


@pytest.mark.parametrize("np", [2, 3])
def test_sys_exit_3_after_init_is_named_first_with_its_code(tmp_path: Path, np: int) -> None:
    code, err = finish(_launch(tmp_path, np, HVD_JOB, "exit3"), 180.0)
    report = _report(err)
    assert code == 3, err
    assert "rank 1 " in report[0] and "exited with code 3" in report[0], err


def test_a_rank_that_vanishes_with_code_0_mid_job_is_named(tmp_path: Path) -> None:
    code, err = finish(_launch(tmp_path, 2, HVD_JOB, "osexit0"), 180.0)
    report = _report(err)
    assert code == 1, err
    assert "rank 1 " in report[0] and "exited with code 0" in report[0], err
    assert "while its peers still waited for it" in report[0], err
    assert any("rank 0 " in line for line in report[1:]), err
    # Its peer names it from the launcher's record, not as a rank whose shutdown ran.
    assert "rank 1 exited with code 0 without leaving the job (os._exit(0)?)" in err, err


def test_ctrl_c_reaches_the_ranks_python(tmp_path: Path) -> None:
    proc = _launch(tmp_path, 2, PLAIN_JOB, str(tmp_path), "interrupt")
    _wait_ready(tmp_path, 2)
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc, 180.0)
    assert code == 130, err
    assert "interrupted: forwarding SIGINT" in err and "job interrupted" in err, err
    for rank in range(2):
        assert (tmp_path / f"caught.{rank}").read_text() == "KeyboardInterrupt", err
        assert (tmp_path / f"finally.{rank}").exists(), err
    assert_gone(_pids(tmp_path, "pid"))


def test_sigterm_is_forwarded_as_sigterm(tmp_path: Path) -> None:
    proc = _launch(tmp_path, 2, PLAIN_JOB, str(tmp_path), "sigterm")
    _wait_ready(tmp_path, 2)
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, 180.0)
    assert code == 143, err
    assert "terminated (SIGTERM): forwarding SIGTERM" in err, err
    assert "job terminated (SIGTERM)" in err, err
    for rank in range(2):
        assert (tmp_path / f"term.{rank}").read_text() == "SIGTERM", err
    assert_gone(_pids(tmp_path, "pid"))


@pytest.mark.parametrize(("mode", "want"), [("ok", 0), ("raise", 1), ("killed", 137)])
def test_what_a_rank_started_ends_with_it(tmp_path: Path, mode: str, want: int) -> None:
    proc = _launch(tmp_path, 2, PLAIN_JOB, str(tmp_path), f"children-{mode}")
    try:
        code, err = finish(proc, 180.0)
        kids = _pids(tmp_path, "kids")
        assert len(kids) == 6, err
        assert code == want, err
    finally:
        assert_gone(_pids(tmp_path, "kids") + _pids(tmp_path, "pid"))
