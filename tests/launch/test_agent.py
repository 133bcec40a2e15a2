"""The agent in this process: a rank's exit is reported even when watching its heartbeat fails."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from typing import Any

import pytest

from ringtrain.environ import Ringtrain
from ringtrain.launch import agent


def _messages(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


@pytest.mark.timeout(60)
def test_a_failing_silence_check_does_not_stop_the_exit_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(pid: int) -> list[Any]:
        raise RuntimeError("psutil cannot read /proc")

    # Every beat is late at once, and reading the rank's process tree fails.
    monkeypatch.setattr(agent, "SILENT_S", 0.0)
    monkeypatch.setattr(agent, "_process_tree", broken)
    out = io.StringIO()
    a = agent.Agent(out)
    beat_once = (
        f"import os, sys, time; os.write(int(os.environ[{Ringtrain.HEARTBEAT_FD!r}]), b'.'); "
        "time.sleep(1.0); sys.exit(3)"
    )
    argv = [sys.executable, "-c", beat_once]
    a.start({"ranks": [{"rank": 0, "env": {}, "argv": argv}], "grace_s": 1.0})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(m["t"] == "done" for m in _messages(out)):
        time.sleep(0.05)
    msgs = _messages(out)
    (exit_,) = [m for m in msgs if m["t"] == "exit"]
    assert exit_["rank"] == 0 and exit_["code"] == 3
    warned = [m["line"] for m in msgs if m["t"] == "out" and m["fd"] == 2]
    assert warned == [
        "ringtrain: cannot watch rank 0's heartbeat any more: "
        "RuntimeError('psutil cannot read /proc')"
    ]


@pytest.mark.timeout(60)
def test_an_agent_inside_another_process_leaves_its_other_children_alone() -> None:
    """Only the agent's own process (python -m ringtrain.launch.agent) ends what is left below
    it: an Agent object in a process with children of its own (a test's worlds, a forkserver)
    must not end or reap them when its ranks are done."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = io.StringIO()
        a = agent.Agent(out)
        a.start({"ranks": [{"rank": 0, "env": {}, "argv": [sys.executable, "-c", ""]}]})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(m["t"] == "done" for m in _messages(out)):
            time.sleep(0.05)
        assert any(m["t"] == "done" for m in _messages(out))
        a.stop_all()
        assert bystander.poll() is None, "the agent ended a process that was not its rank's"
    finally:
        bystander.kill()
        bystander.wait()


# Rank 0 waits on a peer that failed: its wait breaks and it says so ("P" on its heartbeat pipe,
# as runtime.heartbeat does) SAY_AFTER seconds after it starts, a moment after the launcher's
# stop came, then ends with its own words and code. Rank 1 knows of nothing and sleeps.
_FD = Ringtrain.HEARTBEAT_FD
_PEER_SAYS_LATE = (
    f"import os, sys, time; fd = int(os.environ[{_FD!r}]); os.write(fd, b'.'); "
    "time.sleep(float(os.environ['SAY_AFTER'])); os.write(fd, b'P'); time.sleep(0.5); "
    "print('rank 0: a peer left the job', flush=True); sys.exit(1)"
)


def _stop_two_ranks(notice_s: float, say_after_s: float) -> dict[int, dict[str, Any]]:
    """Start the two ranks above, stop them at once with ``notice_s``; each rank's exit."""
    out = io.StringIO()
    a = agent.Agent(out)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    env = {"SAY_AFTER": str(say_after_s)}
    ranks = [{"rank": 0, "env": env, "argv": [sys.executable, "-c", _PEER_SAYS_LATE]}]
    a.start({"ranks": [*ranks, {"rank": 1, "env": {}, "argv": sleeper}], "grace_s": 20.0})
    a.stop_all(notice_s)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(m["t"] == "done" for m in _messages(out)):
        time.sleep(0.05)
    return {m["rank"]: m for m in _messages(out) if m["t"] == "exit"}


@pytest.mark.timeout(90)
def test_a_stop_after_a_failure_lets_the_peers_say_so_first() -> None:
    """The launcher's stop after a failure gives the ranks that have not said they are failing
    a notice (agent.PEER_NOTICE_S) before SIGTERM: a peer whose wait broke at the failed rank's
    exit says so within it and then ends alone, with its own code and words. Without the
    notice, SIGTERM came first and ended it without them."""
    exits = _stop_two_ranks(notice_s=6.0, say_after_s=0.5)  # it speaks within the notice
    assert exits[0]["code"] == 1 and exits[0]["signal"] is None, exits[0]
    assert exits[1]["signal"] == "SIGTERM", exits[1]  # sent at the notice's end: it never spoke
    # Without the notice, SIGTERM comes before it speaks: at 0.5 s, a suite beside stress-ng
    # had delayed the stop past it once (rank 0 ended by itself, code 1).
    exits = _stop_two_ranks(notice_s=0.0, say_after_s=10.0)
    assert exits[0]["signal"] == "SIGTERM", exits[0]
