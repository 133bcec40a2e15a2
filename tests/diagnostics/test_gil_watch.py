"""A rank whose Python stops (a C call holding the GIL) prints where its threads are
(diagnostics/gil_watch.py): in this process, in a forked child's exit, and under ``ringtrain
run`` while its peer waits in an allreduce, whose control round says what it waits for."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ringtrain.config import Config
from ringtrain.diagnostics import gil_watch


def _held_in_c(seconds: int) -> None:
    ctypes.PyDLL(None).sleep(seconds)  # libc's sleep, called without releasing the GIL


def _watch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "ringtrain-gil-watch"]


@pytest.mark.timeout(30)
def test_a_process_holding_the_gil_in_c_prints_its_stacks_then_says_so(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ringtrain")
    gil_watch.start(0.5, rank=3)
    try:
        _held_in_c(2)
        time.sleep(0.5)  # Python runs again: the watch re-arms and says what happened
    finally:
        gil_watch.stop()
    err = capfd.readouterr().err
    assert "Timeout (0:00:00.500000)!" in err, err
    line = _held_in_c.__code__.co_firstlineno + 1
    assert f'File "{__file__}", line {line} in _held_in_c' in err, err
    said = [r.getMessage() for r in caplog.records if "no Python ran" in r.getMessage()]
    assert len(said) == 1, said
    held = float(said[0].split("for at least ")[1].split(" s:")[0])
    assert 1.0 < held < 4.0, said  # the 2 s call, less up to the thread's own 0.125 s wait
    assert "a call into C code held the GIL" in said[0]
    assert "after 'Timeout (...)!', 0.5 s into it, show where its threads were" in said[0]
    assert not _watch_threads() and not gil_watch.active()


@pytest.mark.timeout(30)
def test_a_process_whose_python_runs_prints_nothing(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    gil_watch.start(0.4, rank=0)
    try:
        assert _watch_threads() == ["ringtrain-gil-watch"]
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # busy Python, GIL held but handed round
            sum(range(10_000))
        time.sleep(0.5)
    finally:
        gil_watch.stop()
    assert "Timeout" not in capfd.readouterr().err
    assert not [r for r in caplog.records if "no Python ran" in r.getMessage()]
    gil_watch.start(0.0, rank=0)  # 0: the stall warning is off, and so is the watch
    assert not _watch_threads() and not gil_watch.active()


def test_under_ringtrain_run_the_watch_speaks_before_the_agent_ends_a_frozen_rank() -> None:
    assert gil_watch.timeout_for(Config(stall_warning_s=60.0), beating=False) == 60.0
    frozen = Config(stall_warning_s=60.0, frozen_after_s=30.0)
    assert gil_watch.timeout_for(frozen, beating=True) == 30.0
    assert gil_watch.timeout_for(Config(stall_warning_s=10.0), beating=True) == 10.0
    assert gil_watch.timeout_for(Config(stall_warning_s=0.0), beating=True) == 0.0  # off


def test_a_round_that_waits_past_the_timeout_is_said_once_by_the_sets_rank_0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="ringtrain")
    rounds: list[tuple[int, float]] = []
    watch = gil_watch._Watch(2.0, rank=4, rounds=lambda: rounds)
    now = time.perf_counter()
    rounds[:] = [(0, now - 1.0), (3, now - 5.0)]  # set 0's round is young; set 3's waits
    watch._look_at_rounds()
    watch._look_at_rounds()  # the same round: said once
    rounds[:] = [(3, now - 3.0)]  # set 3's next round waits too
    watch._look_at_rounds()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("ringtrain: rank 4: process set 3's control round has waited 5 s")
    assert said[1].startswith("ringtrain: rank 4: process set 3's control round has waited 3 s")
    assert "a rank that runs no Python (a call into C code holding the GIL" in said[0]


@pytest.mark.timeout(30)
def test_the_scripts_own_watchdog_gives_way_to_the_watch(capfd: pytest.CaptureFixture[str]) -> None:
    """CPython keeps one watchdog per process: one a script armed before init() is replaced."""
    faulthandler.dump_traceback_later(0.3)
    gil_watch.start(30.0, rank=0)
    try:
        _held_in_c(1)
    finally:
        gil_watch.stop()
    assert "Timeout" not in capfd.readouterr().err


def _rounds_fail() -> list[tuple[int, float]]:
    raise RuntimeError("ringtrain is not initialized")


def test_a_runtime_shutting_down_under_the_watch_says_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gil_watch._Watch(2.0, rank=0, rounds=_rounds_fail)._look_at_rounds()
    assert not caplog.records


def _watched() -> tuple[int, bool, bool]:
    import ringtrain.torch as hvd

    size, watched = hvd.size(), gil_watch.active()
    hvd.shutdown()
    after = gil_watch.active()
    hvd.init()  # the shared world as the next test expects it
    return size, watched, after


def test_a_rank_with_peers_is_watched_until_shutdown_and_one_alone_is_not(world) -> None:
    assert world.run(_watched) == [(world.size, world.size > 1, False)] * world.size


FORKS = """\
import ctypes, os, sys
from ringtrain.diagnostics import gil_watch
gil_watch.start(1.0, rank=0)
for child in range(2):
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # a normal exit: with a watchdog armed across the fork, it would hang here
    os.waitpid(pid, 0)
print("both children ended", flush=True)
ctypes.PyDLL(None).sleep(2)  # the parent is still watched
gil_watch.stop()
"""


@pytest.mark.timeout(60)
def test_a_forked_child_that_exits_normally_ends(tmp_path: Path) -> None:
    """CPython's watchdog is not fork-safe: a child that exits normally while one is armed
    waits forever for the parent's watchdog thread (checked on Python 3.11)."""
    script = tmp_path / "forks.py"
    script.write_text(FORKS)
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a child that hangs goes with its parent, below
    )
    try:
        out, _ = proc.communicate(timeout=45)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, out
    assert out.startswith("both children ended\nTimeout (0:00:01)!\n"), out


HELD = """\
import ctypes, torch, ringtrain.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(4), name="before")
if hvd.rank() == 1:
    ctypes.PyDLL(None).sleep(6)  # an extension's call that keeps the GIL
print("sum", hvd.allreduce(torch.ones(4), name="after", op=hvd.Sum).tolist())
"""


@pytest.mark.timeout(120)
def test_under_ringtrain_run_a_rank_holding_the_gil_says_where_it_was(tmp_path: Path) -> None:
    script = tmp_path / "held.py"
    script.write_text(HELD)
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--stall-warning-time", "2"]
    argv += ["--", sys.executable, str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "[0] sum [2.0, 2.0, 2.0, 2.0]" in out and "[1] sum [2.0, 2.0, 2.0, 2.0]" in out, out
    lines = out.splitlines()
    assert "[1] Timeout (0:00:02)!" in lines, out
    assert f'[1]   File "{script}", line 5 in <module>' in lines, out
    assert any(
        line.startswith("[1] ringtrain: rank 1: no Python ran in this process for ")
        for line in lines
    ), out
    assert not any(line.startswith("[0] Timeout") for line in lines), out  # rank 0 ran Python
    waited = [line for line in lines if "control round has waited" in line]
    assert waited, out  # by the set's rank 0 (once per round: unit-tested above)
    assert waited[0].startswith("[0] ringtrain: rank 0: process set 0's control round has "), out
    assert "a rank that runs no Python (a call into C code holding the GIL" in waited[0], out
