"""A test run stopped by SIGTERM tears its fixtures down, under xdist too (tests/_interrupts.py):
a small suite, run by pytest in a child process with the project's handler, is sent SIGTERM
while its tests sleep; each worker's session fixture must have run its teardown, however long
that takes, and a worker deaf to the signal must not hold the run for ever."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import _interrupts
_interrupts.GRACE_S = float({{grace}})

def pytest_configure(config):
    _interrupts.install(config)
"""

SLEEPY = """
import os, time
from pathlib import Path
import pytest

OUT = Path(os.environ["HARNESS_OUT"])
TEARDOWN_S = float(os.environ["HARNESS_TEARDOWN_S"])

@pytest.fixture(scope="session")
def held():
    me = os.environ.get("PYTEST_XDIST_WORKER", "main")
    yield me
    # A teardown as slow as a busy cluster's (its jobs' ranks stopped, hosts removed): under
    # xdist, longer than the 10 s it gives its workers once the controller itself stops.
    time.sleep(TEARDOWN_S)
    (OUT / f"{me}.down").write_text("torn down")

@pytest.mark.parametrize("n", range(4))
def test_sleeps(held, n):
    (OUT / f"{held}.{n}.up").write_text("running")
    time.sleep(120)
"""

# A test that ignores SIGTERM, as one inside a long C call does until the call returns.
DEAF = """
import os, signal, time
from pathlib import Path

def test_deaf():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (Path(os.environ["HARNESS_OUT"]) / "deaf.up").write_text("running")
    time.sleep(120)
"""


def _in_tests(out: Path) -> set[str]:
    """The processes (xdist workers, "main", or "deaf") that have started a test."""
    return {p.name.split(".")[0] for p in out.glob("*.up")}


def _stopped_run(
    tmp_path: Path,
    args: list[str],
    suite_text: str,
    started: Callable[[set[str]], bool],
    grace: float,
    teardown_s: float = 0.0,
) -> tuple[set[str], str, float]:
    """Run ``suite_text`` with pytest ``args``, send pytest SIGTERM once ``started`` holds for
    the set of processes in a test, and return the files the run left, its output and how long
    it took to end after the signal."""
    suite, out = tmp_path / "suite", tmp_path / "out"
    suite.mkdir()
    out.mkdir()
    (suite / "conftest.py").write_text(CONFTEST.format(grace=grace))
    (suite / "test_suite.py").write_text(suite_text)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(suite)]
    env = {**os.environ, "HARNESS_OUT": str(out), "HARNESS_TEARDOWN_S": str(teardown_s)}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test's own worker name is not the child's
    family: list[psutil.Process] = []
    with subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as run:
        try:
            deadline = time.monotonic() + 90
            while not started(_in_tests(out)) and time.monotonic() < deadline:
                assert run.poll() is None, run.communicate()[0]
                family = psutil.Process(run.pid).children(recursive=True)  # for the finally
                time.sleep(0.1)
            assert started(_in_tests(out)), "the tests never started"
            family = psutil.Process(run.pid).children(recursive=True)
            sent = time.monotonic()
            run.send_signal(signal.SIGTERM)  # to pytest alone, as `kill` or a CI timeout sends it
            output, _ = run.communicate(timeout=90)
            took = time.monotonic() - sent
            _, alive = psutil.wait_procs(family, timeout=15)
            assert alive == [], alive  # no worker outlives the run
        finally:  # a failed check leaves nothing behind either
            for p in [psutil.Process(run.pid), *family] if run.poll() is None else family:
                with contextlib.suppress(psutil.Error):
                    p.kill()
    return {p.name for p in out.iterdir()}, output, took


@pytest.mark.timeout(180)
def test_sigterm_tears_every_xdist_workers_fixtures_down(tmp_path: Path) -> None:
    left, output, _ = _stopped_run(
        tmp_path, ["-n", "2"], SLEEPY, lambda s: s == {"gw0", "gw1"}, grace=120, teardown_s=12
    )
    assert {"gw0.down", "gw1.down"} <= left, output
    assert "KeyboardInterrupt" in output or "Interrupted" in output, output


@pytest.mark.timeout(180)
def test_sigterm_tears_the_fixtures_down_without_xdist(tmp_path: Path) -> None:
    left, output, _ = _stopped_run(
        tmp_path, ["-p", "no:xdist"], SLEEPY, lambda s: s == {"main"}, grace=120, teardown_s=2
    )
    assert "main.down" in left, output


@pytest.mark.timeout(180)
def test_a_worker_deaf_to_sigterm_holds_the_run_no_longer_than_the_grace(tmp_path: Path) -> None:
    """After GRACE_S (1 s here) the controller stops as a second SIGTERM stops it, and xdist
    stops the deaf worker: the run ends instead of waiting for the test's 120 s sleep."""
    _, output, took = _stopped_run(tmp_path, ["-n", "2"], DEAF, lambda s: s == {"deaf"}, grace=1)
    assert took < 90, output  # the grace (1 s), then xdist's 10 s for its workers; not 120 s
