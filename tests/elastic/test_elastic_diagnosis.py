"""Diagnosis across a membership change: the launcher and every survivor log who left and why,
each process's timeline runs on in one file, and straggler reports go on in the new world."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.diagnostics import timeline

JOB = Path(__file__).parent / "elastic_job.py"


@pytest.mark.timeout(300)
def test_logs_timeline_and_straggler_reports_carry_over(tmp_path: Path) -> None:
    env = {**os.environ, "VICTIM": "1", "OMP_NUM_THREADS": "1", "MODE": "optimizer"}
    trace = tmp_path / "t.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            "-np",
            "3",
            "--min-np",
            "2",
            "--elastic-timeout",
            "60",
            "--timeline-filename",
            str(trace),
            "--straggler-report-steps",
            "4",
            sys.executable,
            str(JOB),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    err = proc.stderr.splitlines()
    # The launcher: who left, how, and the new world.
    assert any(
        "rank 1 (host localhost" in line
        and "was killed by SIGKILL" in line
        and "re-forming the world with the 2 remaining rank(s) [0, 2] (generation 1)" in line
        for line in err
    ), proc.stderr
    # Every survivor: who left and why, and its new rank.
    for who, new_rank in (("0", 0), ("2", 1)):
        (line,) = [x for x in err if x.startswith(f"[{who}] ringtrain elastic: generation 1:")]
        assert "rank(s) [1] left (a peer failed: " in line
        assert line.endswith(f"rank {who} is now rank {new_rank} of 2")
    # Every survivor says what failed before it waits for the new world: it asks for one, or
    # joins the one announced if the launcher saw the loss first.
    for who in ("0", "2"):
        assert any(
            x.startswith(f"[{who}] ringtrain elastic: rank {who}: ")
            and (
                re.search(
                    r"; re-forming: asked the launcher for a new world, waiting up to "
                    r"\d+ s for it$",
                    x,
                )
                or x.endswith("; re-forming: joining the world the launcher announced")
            )
            for x in err
        ), proc.stderr
    # Straggler reports before and after the change (rank 0 of each world logs them).
    change = err.index(next(x for x in err if x.startswith("[0] ringtrain elastic: generation")))
    reports = [i for i, x in enumerate(err) if x.startswith("[0] ringtrain straggler report:")]
    assert any(i < change for i in reports) and any(i > change for i in reports), proc.stderr
    # One timeline file per process, named by the rank it started as, spanning the change.
    for who in (0, 2):
        events = timeline.load(str(tmp_path / f"t.rank{who}.json"))
        assert {e["pid"] for e in events} == {who}
        (marker,) = [e for e in events if e["name"] == "WORLD CHANGE"]
        assert marker["args"]["members"] == [0, 2] and marker["args"]["generation"] == 1
        assert "rank(s) [1] left" in marker["args"]["change"]
        spans = [e for e in events if e.get("ph") == "X"]
        assert any(e["ts"] < marker["ts"] for e in spans)
        assert any(e["ts"] > marker["ts"] and e["name"] == "ALLREDUCE" for e in spans)
    # The killed rank's file is never overwritten by a renumbered survivor, and the documented
    # merge works with it (its writer may have died before writing anything).
    files = sorted(str(p) for p in tmp_path.glob("t.rank*.json"))
    assert len(files) == 3
    merged = tmp_path / "merged.json"
    timeline.merge(files, str(merged))
    pids = {e["pid"] for e in json.loads(merged.read_text())["traceEvents"]}
    assert {0, 2} <= pids


def test_a_change_names_who_left_and_joined_and_why() -> None:
    from ringtrain.elastic.run import describe_change
    from ringtrain.errors import CollectiveAbortedError, PeerFailedError
    from ringtrain.runtime import membership

    world = membership.Roster(2, (0, 2, 3))
    assert describe_change((0, 1, 2), world, None) == (
        "rank(s) [1] left and rank(s) [3] joined (the launcher announced new hosts)"
    )
    failed = CollectiveAbortedError("a peer failed: boom\nmore detail")
    assert describe_change((0, 1, 2, 3), world, failed) == (
        "rank(s) [1] left (a peer failed: CollectiveAbortedError: a peer failed: boom)"
    )
    # No rank left: the same ranks re-formed after a collective failed (a rank's request).
    assert describe_change((0, 2, 3), world, failed) == (
        "the world was re-formed (a collective failed: CollectiveAbortedError: a peer failed: boom)"
    )
    # A peer that stopped on a preemption (it posted so: runtime/departures.py) did not fail.
    stopped = PeerFailedError(
        "rank 0: a peer left the job: rank 1 stopped ...", (1,), preempted=True
    )
    assert describe_change((0, 1, 2, 3), world, stopped) == (
        "rank(s) [1] left (a peer stopped on a preemption: PeerFailedError: rank 0: a peer left "
        "the job: rank 1 stopped ...)"
    )


def test_a_change_keeps_the_transport_s_reason_and_cuts_between_words() -> None:
    # A SIGKILLed peer, as a survivor reported it: the reason came last and was cut to "Conne".
    from ringtrain.elastic.run import describe_change
    from ringtrain.errors import CollectiveAbortedError
    from ringtrain.runtime import membership

    failed = CollectiveAbortedError(
        "collectives of process set 0 stopped: a peer rank failed or became unreachable "
        "(RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
        "Read error [127.0.0.1]:41866: Connection reset by peer. This is typically caused by a "
        "remote worker hanging or bugs in the application. Check the logs of the remote worker "
        "before reporting an error.).\nHINT: the launcher's message names the rank that failed"
    )
    said = describe_change((0, 1), membership.Roster(1, (0,)), failed)
    assert "(RuntimeError: Read error [127.0.0.1]:41866: Connection reset by peer." in said, said
    assert said.endswith(" ...)") and len(said) < 300, said
