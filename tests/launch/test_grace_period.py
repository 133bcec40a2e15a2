"""The grace period after Ctrl-C or SIGTERM (``--grace-period``, ``RINGTRAIN_GRACE_PERIOD_S``).

- the signal is forwarded once: a rank that saves in its SIGTERM handler for longer than the
  old fixed 3 s finishes its save, its handler entered once; a rank that ignores the signal
  is SIGKILLed when the grace period ends, and the launcher's last message names it apart
  from the ranks that exited in time; a second Ctrl-C kills every rank at once;
- a peer that outlives a Ctrl-C (it ignores SIGINT and goes on with collectives) hears that
  the job was interrupted, not that rank 0 failed.

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

import psutil
import pytest

from _launcher_runs import assert_gone, finish
from ringtrain.config import Config
from ringtrain.deploy import manifests
from ringtrain.deploy.render import to_yaml
from ringtrain.deploy.spec import JobSpec
from ringtrain.launch import agent
from ringtrain.launch.failures import Interruption

pytestmark = pytest.mark.timeout(240)

# No torch. Rank 0 saves for SAVE_S in its handler; rank 1 ignores the signal.
PLAIN_JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    out, sig = sys.argv[1], getattr(signal, sys.argv[2])
    rank = int(os.environ["RINGTRAIN_RANK"])

    def note(name, text=""):
        with open(os.path.join(out, f"{name}.{rank}"), "a") as f:
            f.write(text)

    def save(signum, frame):
        note("handler", "entered ")
        time.sleep(4.0)  # longer than the old fixed 3 s
        note("saved")
        sys.exit(0)

    note("pid", str(os.getpid()))
    signal.signal(sig, save if rank == 0 else signal.SIG_IGN)
    note("ready")
    for _ in range(600):
        time.sleep(0.1)
    """
)

# Rank 1 ignores Ctrl-C and goes on with collectives; rank 0 takes KeyboardInterrupt.
HVD_JOB = textwrap.dedent(
    """
    import os, signal, sys, torch
    import ringtrain.torch as hvd
    out = sys.argv[1]
    hvd.init()
    if hvd.rank() == 1:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(os.path.join(out, f"pid.{hvd.rank()}"), "w") as f:
        f.write(str(os.getpid()))
    for step in range(1000000):
        hvd.allreduce(torch.ones(2), name="a")
        if step == 2:
            open(os.path.join(out, f"ready.{hvd.rank()}"), "w").close()
    """
)


def _launch(
    tmp_path: Path,
    script: str,
    flags: list[str],
    args: list[str],
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    path = tmp_path / "job.py"
    path.write_text(script)
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", *flags, "--"]
    return subprocess.Popen(
        [*argv, sys.executable, str(path), str(tmp_path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def _wait_ready(tmp_path: Path, proc: subprocess.Popen[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(tmp_path.glob("ready.*"))) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"ranks not ready: {proc.communicate()[1]}")
        time.sleep(0.05)
    time.sleep(0.2)  # the handlers are in place before "ready"; let the loop begin


def _assert_gone(tmp_path: Path) -> None:
    assert_gone([int(f.read_text()) for f in tmp_path.glob("pid.*")])


def test_the_default_grace_period_is_20_s_and_the_flag_is_in_the_help() -> None:
    assert Config().grace_period_s == 20.0
    help_text = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert "--grace-period" in help_text and "default 20" in " ".join(help_text.split())


def test_the_k8s_manifests_neither_run_the_launcher_nor_set_a_termination_grace_period() -> None:
    """docs/launch.md: nothing in them to keep in step with --grace-period."""
    spec = JobSpec.from_mapping(
        {
            "name": "m",
            "image": "i:1",
            "command": ["python", "t.py"],
            "replicas": 2,
            "slots": 2,
            "cpus": 2,
        }
    )
    for target in ("pytorchjob", "mpijob", "trainjob"):
        text = to_yaml(manifests.generate(spec, target))
        assert "terminationGracePeriodSeconds" not in text and "ringtrain run" not in text


def test_the_report_names_killed_ranks_apart_from_those_in_time() -> None:
    ends = Interruption("SIGINT", 20.0, in_time=[2, 0], killed=[1])
    assert ends.report().splitlines()[:2] == [
        "job interrupted: ranks 0, 2 exited within the grace period of 20 s after SIGINT",
        "rank 1 did not exit within the grace period of 20 s after SIGINT; killed",
    ]
    assert "--grace-period" in ends.report().splitlines()[-1]
    assert Interruption("SIGTERM", 5.0, in_time=[0]).report() == (
        "job terminated (SIGTERM): every rank exited within the grace period of 5 s after SIGTERM"
    )
    at_once = Interruption("SIGINT", 20.0, killed=[0], at_once=True).report()
    assert at_once == "job interrupted\nrank 0 was killed at once by the second SIGINT"


def test_ranks_that_all_stopped_at_a_save_say_so_and_one_that_did_not_is_an_exit() -> None:
    """A durable job's ranks answer SIGTERM with a save of the step they stop at (exit 143,
    said to their agents): the report says how to go on; a rank that only exited does not."""
    ends = Interruption("SIGTERM", 5.0)
    for rank in (1, 0):
        ends.ended({"rank": rank, "code": 143, "preempted": True})
    assert ends.at_a_save() and ends.report() == (
        "job terminated (SIGTERM): every rank stopped within the grace period of 5 s after "
        "SIGTERM at the step the job saved (to continue, run the job again with --resume and "
        "its checkpoint directory)"
    )
    ends.ended({"rank": 2, "code": 143})  # a bare 143: Python's default SIGTERM, no save
    assert not ends.at_a_save() and ends.report().endswith(
        "every rank exited within the grace period of 5 s after SIGTERM"
    )
    killed = Interruption("SIGTERM", 5.0)
    killed.ended({"rank": 0, "code": 143, "preempted": True})
    killed.ended({"rank": 1, "killed": True, "signal": "SIGKILL"})
    assert not killed.at_a_save() and "rank 1 did not exit" in killed.report()


def test_a_rank_saving_on_sigterm_finishes_and_one_that_ignores_it_is_killed(
    tmp_path: Path,
) -> None:
    proc = _launch(tmp_path, PLAIN_JOB, ["--grace-period", "8"], ["SIGTERM"])
    _wait_ready(tmp_path, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc, 120.0)
    took = time.monotonic() - sent
    assert code == 143, err
    assert "they have 8 s to exit" in err, err
    # Rank 0's handler ran once to its end: no second SIGTERM restarted it, no SIGKILL cut it.
    assert (tmp_path / "handler.0").read_text() == "entered ", err
    assert (tmp_path / "saved.0").exists(), err
    in_time = "job terminated (SIGTERM): rank 0 exited within the grace period of 8 s after SIGTERM"
    assert in_time in err, err
    assert "rank 1 did not exit within the grace period of 8 s after SIGTERM; killed" in err, err
    assert 7.5 <= took < 60, (took, err)  # rank 1 lived until the grace period ended
    _assert_gone(tmp_path)


def test_ctrl_c_is_no_failure_for_a_peer_that_outlives_it(tmp_path: Path) -> None:
    # The grace period from the variable here (the flag above): the same setting.
    proc = _launch(tmp_path, HVD_JOB, [], [], {"RINGTRAIN_GRACE_PERIOD_S": "60"})
    _wait_ready(tmp_path, proc)
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc, 180.0)
    assert code == 130, err
    assert "PeerFailedError: rank 1: a peer left the job" in err, err
    assert ") left: the job was interrupted (SIGINT from the launcher)" in err, err
    assert "HINT: no rank failed: the job was interrupted" in err, err
    assert "sys.exit or os._exit" not in err and "fix it" not in err, err
    # Rank 1 ended on its error, in time: nobody was killed.
    assert "every rank exited within the grace period of 60 s after SIGINT" in err, err
    _assert_gone(tmp_path)


def test_a_second_ctrl_c_kills_at_once(tmp_path: Path) -> None:
    proc = _launch(tmp_path, PLAIN_JOB, [], ["SIGINT"])  # the default grace period, 20 s
    _wait_ready(tmp_path, proc)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    while not (tmp_path / "handler.0").exists():  # rank 0 is saving
        assert time.monotonic() - sent < 30, "rank 0's handler never ran"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc, 120.0)
    assert code == 130, err
    assert time.monotonic() - sent < 15, err
    assert not (tmp_path / "saved.0").exists(), err  # killed mid-save: the user asked for it
    for rank in (0, 1):
        assert f"rank {rank} was killed at once by the second SIGINT" in err, err
    _assert_gone(tmp_path)


# Each rank notes every SIGTERM it gets, and ends 1.5 s after the first (time for another).
COUNTING_JOB = textwrap.dedent(
    """
    import os, signal, sys, time
    out = sys.argv[1]
    rank = int(os.environ["RINGTRAIN_RANK"])
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(time.time()))
    with open(os.path.join(out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    open(os.path.join(out, f"ready.{rank}"), "w").close()
    while not got:
        time.sleep(0.02)
    time.sleep(1.5)
    with open(os.path.join(out, f"got.{rank}"), "w") as f:
        f.write(" ".join(repr(t) for t in got))
    """
)


def _sigterms(tmp_path: Path) -> list[list[float]]:
    return [[float(t) for t in f.read_text().split()] for f in sorted(tmp_path.glob("got.*"))]


@pytest.mark.parametrize("signalled", ["every-process", "agent-alone"])
def test_a_sigterm_to_the_agent_too_reaches_each_rank_once_from_the_launcher(
    tmp_path: Path, signalled: str
) -> None:
    """Slurm signals every process of a cancelled job: the launcher, its agent and the ranks.
    The agent leaves the passing on to the launcher, so each rank gets Slurm's SIGTERM and the
    launcher's (two a handler sees; Python may merge two that come at once), not a third.
    An agent signalled alone passes it on itself, ``agent.TERM_WAIT_S`` later."""
    proc = _launch(tmp_path, COUNTING_JOB, [], [])
    _wait_ready(tmp_path, proc)
    launcher = psutil.Process(proc.pid)
    agents = [p for p in launcher.children() if "ringtrain.launch.agent" in p.cmdline()]
    assert len(agents) == 1, launcher.children()
    ranks = [int(f.read_text()) for f in tmp_path.glob("pid.*")]
    sent = time.time()
    targets = [agents[0].pid] if signalled == "agent-alone" else [proc.pid, agents[0].pid, *ranks]
    for pid in targets:
        os.kill(pid, signal.SIGTERM)
    code, err = finish(proc, 120.0)
    got = _sigterms(tmp_path)
    assert len(got) == 2, err
    if signalled == "agent-alone":
        assert code == 0, err  # the ranks ended by themselves
        for times in got:
            assert len(times) == 1 and times[0] - sent >= agent.TERM_WAIT_S - 0.1, (times, sent)
    else:
        assert code == 143 and "every rank exited within the grace period" in err, err
        assert all(1 <= len(times) <= 2 for times in got), (got, sent, err)
    _assert_gone(tmp_path)
