"""The launcher's failure report: the root cause first, by when it happened, not when heard.

Pure tests of :mod:`ringtrain.launch.failures`, then one real ``ringtrain run`` job (torch-free
ranks) in which three ranks fail at nearly the same time and the first to fail is named first.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringtrain.checkpoint.preemption import EXIT_CODE
from ringtrain.launch.failures import (
    PREEMPTED_CODE,
    Failure,
    acted_on,
    exit_failure,
    report,
    root_cause,
    stopped_on_preemption,
    survived_report,
)


def _failure(rank: int, at: float, code: int = 1, tail: list[str] | None = None) -> Failure:
    desc = f"rank {rank} (host h, pid {100 + rank}) exited with code {code} after 1.0 s"
    return Failure(rank, "h", code, desc, tail or [f"[rank{rank}]: ValueError: {rank}"], at)


def test_the_earliest_failure_is_the_root_cause_whatever_arrived_first() -> None:
    heard = [_failure(0, at=10.5), _failure(2, at=10.1, code=7), _failure(1, at=10.3)]
    cause = root_cause(heard)
    assert cause.rank == 2 and cause.code == 7
    text = report(heard)
    first, second = text.splitlines()[:2]
    assert first.startswith("job failed: rank 2 ") and "root cause" in second
    # Rank 0's end was heard of first (the live line named it): the report says why it is not
    # the cause.
    assert "rank 0, whose end was heard of first and stopped the job" in second
    # Heard of first and the cause: nothing to explain.
    in_order = report([_failure(2, at=10.1), _failure(0, at=10.5)]).splitlines()[1]
    assert in_order == "(the root cause: the rank that failed first; the others are listed below)"
    assert text.index("rank 1 ") < text.index("rank 0 ")  # the others in the order they failed
    assert "2 other rank(s) failed after it" in text


def test_peers_that_ended_alike_are_one_entry() -> None:
    same = ["[rank{}]: ringtrain.errors.PeerFailedError: rank 3 failed (ValueError: x)"]
    peers = [_failure(r, at=5.0 + r, tail=[same[0].format(r)]) for r in range(3)]
    text = report([_failure(3, at=4.0), *peers])
    assert "ranks 0, 1, 2 ended alike" in text
    assert text.count("PeerFailedError") == 1


def test_one_failure_reads_as_before() -> None:
    text = report(_failure(1, at=1.0))
    assert (
        text.splitlines()[0]
        == "job failed: rank 1 (host h, pid 101) exited with code 1 after 1.0 s"
    )
    assert "other rank" not in text


def _finished(rank: int, at: float) -> Failure:
    desc = f"rank {rank} (host h, pid {100 + rank}) exited with code 0 after 1.0 s"
    return Failure(rank, "h", 1, desc, [], at, finished=True)


def test_a_rank_that_left_with_code_0_is_named_where_the_peers_only_say_so() -> None:
    peer = _failure(0, at=5.0)
    peer.after_peer = True
    text = report([_finished(1, at=4.0), peer])
    assert text.splitlines()[0].startswith("job failed: rank 1 (host h, pid 101) exited with")
    assert "while its peers still waited for it" in text
    assert root_cause([_finished(1, at=4.0), peer]).code == 1  # never 0 for a failed job
    # A rank that failed on its own is the cause; ranks that exited 0 are not mentioned.
    own = _failure(0, at=5.0)
    assert report([_finished(1, at=4.0), own]).splitlines()[0].startswith("job failed: rank 0")
    assert "rank 1" not in report([_finished(1, at=4.0), own])
    # Nor is a rank that exited 0 well after the peers failed.
    assert "rank 1" not in report([_finished(1, at=9.0), peer])


def test_no_negative_delays() -> None:
    text = report([_failure(1, at=5.0), _failure(0, at=4.99, tail=["other words"])])
    assert "-0.0" not in text and "at about the same time" in text


def _exit(rank: int, code: int, said: bool = True) -> dict[str, object]:
    """An agent's exit message (agent.py): ``said``, the rank said it stops on a preemption."""
    tail = [f"rank {rank}: the job stops at step 12, saved into ck"] if rank == 0 else []
    return {"rank": rank, "code": code, "signal": None, "tail": tail, "preempted": said}


def test_ranks_that_stopped_on_a_preemption_are_no_failure() -> None:
    """A durable job's ranks that stop at a step they saved (checkpoint/preemption.py) end the
    job with 143, reported as a preemption, not as "job failed" with a root cause."""
    assert PREEMPTED_CODE == EXIT_CODE
    stopped = [exit_failure("h", _exit(r, 143), 100 + r, 9.0) for r in (1, 0)]
    assert all(f.preempted and f.code == 143 for f in stopped)
    assert stopped[0].description == (
        "rank 1 (host h, pid 101) stopped on a preemption at a step it saved (exit code 143) "
        "after 9.0 s"
    )
    assert acted_on(stopped[0], 1).endswith("; the other 1 rank(s) stop at the same step.")
    text = report(stopped)
    assert text.startswith("job stopped on a preemption: ranks 0, 1 exited with code 143")
    assert "job failed" not in text and "root cause" not in text
    assert "  | rank 0: the job stops at step 12, saved into ck" in text  # rank 0 says where
    # Said, but then not the stop's code (the save failed: a traceback, exit 1): a failure,
    # and the root cause over the ranks that did stop.
    broken = exit_failure("h", _exit(2, 1), 102, 9.5)
    assert not broken.preempted
    mixed = report([*stopped, broken])
    assert mixed.startswith("job failed: rank 2 ") and root_cause([*stopped, broken]) is broken
    assert not exit_failure("h", _exit(3, 143, said=False), 103, 1.0).preempted  # a bare 143
    assert acted_on(broken, 2).endswith("; stopping the other 2 rank(s).")
    # An elastic job that went on without a preempted rank says so, not that it failed.
    assert "earlier, 1 rank(s) stopped on a preemption and the job went on" in survived_report(
        stopped[:1], 2
    )
    both = survived_report([stopped[0], broken], 2)
    assert "earlier, 1 rank(s) failed and 1 rank(s) stopped on a preemption and" in both
    # ... and one whose last world then stopped on a preemption stopped on a preemption (as
    # for its exit code, its last world counts), the ranks it went on without listed after.
    assert stopped_on_preemption(stopped)
    last = report(stopped, absorbed=[broken])
    assert last.startswith("job stopped on a preemption: ranks 0, 1 exited with code 143")
    assert "job failed" not in last and "root cause" not in last
    assert "earlier, 1 rank(s) failed and the job went on without them (elastic):" in last
    assert "  - rank 2 (host h, pid 102) exited with code 1 after 9.5 s" in last


def test_ranks_preempted_at_one_step_of_one_world_are_one_stop() -> None:
    """Ranks 1 and 2 of an elastic job stop at step 21 of world 0, but the launcher hears of
    rank 1 first and re-forms the world with ranks 0 and 2: both stopped the job at that step,
    neither went on without the other. A rank stopped at the same step number of another world
    (a world re-formed from an earlier commit may reach it again) was an earlier stop."""

    def stopped(rank: int, step: int, world: int) -> Failure:
        msg = {**_exit(rank, 143), "preempted_at": [step, world]}
        return exit_failure("h", msg, 100 + rank, 9.0 + rank / 10)

    first, second = stopped(1, 21, 0), stopped(2, 21, 0)
    assert first.stop == (21, 0) and exit_failure("h", _exit(3, 143), 103, 1.0).stop is None
    one = report([second], absorbed=[first])
    assert one.startswith(
        "job stopped on a preemption: ranks 1, 2 exited with code 143 at step 21, the step the "
        "job saved (to continue"
    ), one
    assert "earlier" not in one, one
    again = report([stopped(2, 21, 1)], absorbed=[first])
    assert again.startswith("job stopped on a preemption: rank 2 exited with code 143 at step 21")
    assert "earlier, 1 rank(s) stopped on a preemption and the job went on" in again, again


# Each rank says it fails on the heartbeat pipe, as ringtrain's except hook does
# (runtime/heartbeat.py), then exits later, in another order: rank 2 fails first and exits
# last, rank 0 fails second and exits first, so the news of rank 0 reaches the launcher first.
# Each event 0.4 s after the one before: within a second, yet apart by more than a loaded
# machine's scheduling delay (50 ms apart, rank 0's signal overtook rank 2's beside stress-ng),
# and every rank has said it fails before the first exit makes the launcher stop the others.
RANKS_FAIL_TOGETHER = textwrap.dedent(
    """
    import os, sys, time
    rank = int(os.environ["RINGTRAIN_RANK"])
    start = float(sys.argv[1])
    fails, exits = {2: (0.0, 2.0), 0: (0.4, 1.2), 1: (0.8, 1.6)}[rank]
    time.sleep(max(0.0, start - time.time()) + fails)
    os.write(int(os.environ["RINGTRAIN_HEARTBEAT_FD"]), b"F")
    print(f"rank {rank} gives up", file=sys.stderr, flush=True)
    time.sleep(exits - fails)
    sys.exit(10 + rank)
    """
)


@pytest.mark.timeout(120)
def test_three_ranks_fail_together_and_the_first_is_named_first(tmp_path: Path) -> None:
    import time

    script = tmp_path / "rank.py"
    script.write_text(RANKS_FAIL_TOGETHER)
    # A start far enough ahead that every rank is running by then, even on a loaded machine.
    start = time.time() + 8.0
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "3", "--"]
    argv += [sys.executable, str(script), repr(start)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 12, proc.stderr  # the root cause's code
    report_text = proc.stderr[proc.stderr.index("ringtrain run: job failed") :]
    assert report_text.splitlines()[0].startswith("ringtrain run: job failed: rank 2 ")
    # The live line named the end heard of first (rank 0's); the report says why it differs.
    live = next(ln for ln in proc.stderr.splitlines() if "stopping the other" in ln)
    assert live.startswith("ringtrain run: rank 0 "), proc.stderr
    assert "rank 0, whose end was heard of first and stopped the job" in report_text
    assert "rank 2 gives up" in report_text
    # The others failed on their own (they said so), and are listed under it in that order.
    assert report_text.index("rank 0 (") < report_text.index("rank 1 (")
    assert "exited with code 10" in report_text and "exited with code 11" in report_text


def test_failures_an_elastic_job_went_on_without_are_listed_after_the_last_worlds() -> None:
    text = report([_failure(0, at=9.0)], absorbed=[_failure(2, at=6.0, tail=["ValueError: 2"])])
    lines = text.splitlines()
    assert lines[1] == (
        "(the root cause: the rank that failed first in the last world; the others are listed "
        "below)"
    )
    tail = lines[
        lines.index("earlier, 1 rank(s) failed and the job went on without them (elastic):") :
    ]
    assert tail == [
        "earlier, 1 rank(s) failed and the job went on without them (elastic):",
        "  - rank 2 (host h, pid 102) exited with code 1 after 1.0 s, 3.0 s earlier",
        "      | ValueError: 2",
    ]


# Torch-free ranks of an elastic job (--min-np 2 of 3): rank 2 fails first and the world goes
# on without it; then rank 0 fails, below --min-np, and the job fails.
ELASTIC_RANKS_FAIL = textwrap.dedent(
    """
    import os, sys, time
    rank = int(os.environ["RINGTRAIN_RANK"])
    time.sleep({2: 0.2, 0: 3.0, 1: 60.0}[rank])  # rank 1 is stopped when the job fails
    print(f"rank {rank} gives up", file=sys.stderr, flush=True)
    sys.exit(10 + rank)
    """
)


@pytest.mark.timeout(120)
def test_an_elastic_jobs_report_lists_the_ranks_it_went_on_without(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(ELASTIC_RANKS_FAIL)
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "3", "--min-np", "2", "--"]
    proc = subprocess.run(
        [*argv, sys.executable, str(script)], capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 10, proc.stderr
    report_text = proc.stderr[proc.stderr.index("ringtrain run: job failed") :]
    assert report_text.splitlines()[0].startswith("ringtrain run: job failed: rank 0 ")
    earlier = report_text[report_text.index("earlier, 1 rank(s) failed and the job went on") :]
    assert "  - rank 2 (host localhost" in earlier and "exited with code 12" in earlier
    assert "rank 2 gives up" in earlier


# Torch-free ranks of an elastic job (--min-np 2 of 3): rank 2 fails, the others finish well.
ELASTIC_RANK_FAILS_JOB_ENDS_WELL = textwrap.dedent(
    """
    import os, sys, time
    rank = int(os.environ["RINGTRAIN_RANK"])
    if rank == 2:
        print("bad batch in rank 2's data", file=sys.stderr, flush=True)
        sys.exit(7)
    time.sleep(3.0)
    """
)


@pytest.mark.timeout(120)
def test_an_elastic_job_that_ends_well_still_names_the_ranks_it_lost(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(ELASTIC_RANK_FAILS_JOB_ENDS_WELL)
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "3", "--min-np", "2", "--"]
    proc = subprocess.run(
        [*argv, sys.executable, str(script)], capture_output=True, text=True, timeout=90
    )
    assert proc.returncode == 0, proc.stderr  # as Horovod's driver: the last world's result
    closing = proc.stderr[proc.stderr.index("ringtrain run: job finished") :].splitlines()
    assert closing[0] == (
        "ringtrain run: job finished: the last world's 2 rank(s) exited 0; earlier, 1 rank(s) "
        "failed and the job went on without them (elastic):"
    )
    assert closing[1].startswith("  - rank 2 (host localhost") and "code 7" in closing[1]
    assert closing[2] == "      | bad batch in rank 2's data"
