"""step() waiting on a rank that stopped taking steps names that rank (engine_wait)."""

from __future__ import annotations

import contextlib
import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.diagnostics.engine_wait import FINISHED, WaitWatch, explain, finished_key
from ringtrain.errors import StallError
from ringtrain.testing.spawn import World


def test_explain_names_each_rank_by_where_it_is() -> None:
    msg = explain(0, 7, 61.0, {0: 7, 1: 7, 2: 9, 3: FINISHED, 4: None}, 300.0)
    assert msg.startswith("ringtrain: step() has waited 61 s for the gradients of step 7;")
    assert "ranks [0, 1] wait there" in msg
    assert "rank 2 waits in step 9: it ran 2 step(s) more than these ranks" in msg
    assert "ranks [3] have finished (ringtrain.shutdown()): they ran fewer steps" in msg
    assert "ranks [4] are not waiting in step()" in msg
    known = explain(0, 7, 61.0, {0: 7, 1: None, 2: None}, 300.0, doing={1: "collective 'm'"})
    assert "rank 1 waits in collective 'm', not in step()" in known
    assert "ranks [2] are not waiting in step()" in known
    assert "ringtrain.join()" in msg and "(300 s, RINGTRAIN_TIMEOUT_S)" in msg
    # With a stall shutdown time below the transport timeout, the warning names that instead.
    ending = explain(0, 7, 61.0, {0: 7, 1: None}, 300.0, shutdown_s=120.0)
    assert ending.endswith(
        "The wait fails at the stall shutdown time (120 s, --stall-shutdown-time) if these "
        "ranks stay away."
    ), ending


def _wait_for(cond: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_long_wait_is_posted_reported_once_and_taken_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = dist.HashStore()
    store.set(finished_key(1), "1")
    watch = WaitWatch(store, "p", 0, [0, 1], warning_s=0.2, timeout_s=300.0)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        watch.begin(3)
        _wait_for(lambda: store.check(["p/waiting/0"]))  # posted at half the warning time
        assert store.get("p/waiting/0") == b"3"
        _wait_for(lambda: caplog.records)
        time.sleep(0.3)
    assert len(caplog.records) == 1  # once per wait
    assert "ranks [1] have finished" in caplog.records[0].getMessage()
    # The hint for step(): the same last step everywhere, since join() does not stand in there.
    assert "end every rank at the same step" in caplog.records[0].getMessage()
    assert "does not stand in for step()" in caplog.records[0].getMessage()
    watch.end()
    _wait_for(lambda: not store.check(["p/waiting/0"]))  # taken back when the wait ends
    # A short wait writes nothing.
    watch.begin(4)
    watch.end()
    time.sleep(0.2)
    assert not store.check(["p/waiting/0"])
    watch.close()


@pytest.mark.parametrize(
    ("me", "members", "logs"),
    [
        (0, [0, 1, 2], True),  # ranks 0-1 wait, rank 2 is elsewhere: rank 0, the lowest, reports
        (2, [0, 1, 2, 3], False),  # ranks 0-2 wait, rank 3 is elsewhere: rank 0 reports
        (0, [0, 1], False),  # every rank waits in this step: a slow exchange, not a stall
    ],
)
def test_who_reports_and_when(
    caplog: pytest.LogCaptureFixture, me: int, members: list[int], logs: bool
) -> None:
    store = dist.HashStore()
    store.set("p/waiting/1", "3")  # rank 1 waits in step 3 too
    if me == 2:
        store.set("p/waiting/0", "3")  # and so does rank 0, below rank 2
    watch = WaitWatch(store, "p", me, members, warning_s=0.1, timeout_s=300.0)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        watch.begin(3)
        _wait_for(lambda: store.check([f"p/waiting/{me}"]))
        time.sleep(0.3)
    watch.end()
    watch.close()
    assert bool(caplog.records) == logs


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The messages ringtrain's logger warns while inside (in a rank: pytest's caplog does not
    reach it)."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("ringtrain").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("ringtrain").removeHandler(handler)


def _uneven_steps() -> tuple[str, str]:
    with _warnings() as records:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
        )
        # Rank 1's data runs out one step early; it leaves, rank 0 waits for it.
        error = ""
        for _ in range(4 if rt.rank() == 0 else 3):
            opt.zero_grad()
            F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
            try:
                opt.step()
            except Exception as e:  # the peer left
                error = f"{type(e).__name__}: {e}"
                break
        return error, "\n".join(r for r in records if "step() has waited" in r)


def test_a_rank_that_finished_early_is_named_while_the_other_waits(world2: World) -> None:
    # Rank 1 shuts down after its last step; its process groups go with it, so rank 0's wait in
    # step() breaks at once (long before the 6 s transport timeout) with an error that names
    # rank 1 from its departure post (runtime.departures), not a bare "connection closed".
    (error, _), (other_error, other_report) = world2.run(
        _uneven_steps, stall_warning_s=1.0, timeout_s=6.0, timeout=60
    )
    assert error.startswith("PeerFailedError: rank 0: a peer left the job"), error
    assert "rank 1 (host" in error and "finished: its script ended" in error, error
    # Nobody failed: the hint says what uneven data needs, not to fix a failure.
    assert "HINT: no rank failed" in error and "end every rank at the same step" in error, error
    assert "does not stand in for step()" in error, error  # join() would not help here
    assert "first failure above" not in error, error
    assert other_error == other_report == ""


def _logged(world: World, rank: int) -> int:
    """How much rank ``rank``'s log holds (its ranks write it from their first run on)."""
    path = Path(world.logs[rank])
    return path.stat().st_size if path.exists() else 0


def _logged_since(world: World, rank: int, before: int) -> str:
    return Path(world.logs[rank]).read_bytes()[before:].decode(errors="replace")


def _one_rank_elsewhere() -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for step in range(2):
        if step == 1 and rt.rank() == 1:
            time.sleep(8.0)  # stuck outside step() past rank 0's transport timeout
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
        try:
            opt.step()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
    return ""


def test_a_wait_past_the_transport_timeout_names_the_rank_elsewhere(world2: World) -> None:
    # Gloo's own error says only that a receive timed out; the error names rank 1, which never
    # came to step().
    before = _logged(world2, 1)
    error, _ = world2.run(_one_rank_elsewhere, stall_warning_s=1.0, timeout_s=4.0, timeout=60)
    assert error.startswith("StallError: step() gave up after "), error
    assert (
        " s, the transport timeout (4 s, RINGTRAIN_TIMEOUT_S), for the gradients of step 2; "
        "ranks [0] wait there.\n" in error
    ), error
    assert "ranks [1] are not waiting in step()" in error, error
    assert "The wait fails" not in error, error
    # Rank 0's report asked rank 1 where it is, and rank 1 said (diagnostics/whereabouts.py).
    told = _logged_since(world2, 1, before)
    assert (
        "rank 1 keeps its peers waiting in step(): ranks [0] wait there for the gradients of "
        "step 2, and this rank is not in step() (the last step it began: 1)." in told
    ), told
    assert "time.sleep(8.0)  # stuck outside step()" in told, told


def _one_rank_away_for(away_s: float, stuck_at: int = 1) -> tuple[str, float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for step in range(2):
        if step == stuck_at and rt.rank() == 1:
            time.sleep(away_s)  # stuck outside step(), in data loading, say
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
        start = time.monotonic()
        try:
            opt.step()
        except Exception as e:
            return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "", 0.0


@pytest.mark.parametrize("stuck_at", [1, 0], ids=["after-a-step", "before-the-first"])
def test_a_wait_ends_at_the_stall_shutdown_time_naming_the_rank_elsewhere(
    world2: World, stuck_at: int
) -> None:
    # Rank 1 stays away from step() 9 s; the stall shutdown time is 2 s, the transport
    # timeout 30 s. The wait in step() ended only when rank 1 came (or at the transport
    # timeout); as for a negotiated collective, it now ends past the shutdown time (plus the
    # moment a waiting peer takes to post, and a second to be sure), naming rank 1. Rank 1
    # then completes what rank 0 left under way, so both ranks leave cleanly. A first step
    # waits in the agreement on its plan before its exchange: watched, and ended, alike.
    before = _logged(world2, 1)
    (error, waited), _ = world2.run(
        _one_rank_away_for, 9.0, stuck_at, stall_warning_s=1.0, stall_shutdown_s=2.0,
        timeout_s=30.0, timeout=90,
    )  # fmt: skip
    assert re.match(
        r"StallError: step\(\) gave up after \d s, past the stall shutdown time, for the "
        rf"gradients of step {stuck_at + 1}; ranks \[0\] wait there.\n",
        error,
    ), error
    # Rank 0's report asked rank 1 where it is, and rank 1 said, also before its first step.
    told = _logged_since(world2, 1, before)
    said = {
        1: "and this rank is not in step() (the last step it began: 1).",
        0: "and this rank has not begun a step yet.",
    }
    assert (
        "rank 1 keeps its peers waiting in step(): ranks [0] wait there for the gradients of "
        f"step {stuck_at + 1}, {said[stuck_at]}" in told
    ), told
    assert "time.sleep(away_s)  # stuck outside step(), in data loading, say" in told, told
    assert "ranks [1] are not waiting in step()" in error, error
    assert error.endswith(
        "ringtrain is stopping the job: the stall exceeded the shutdown time of 2 s "
        "(--stall-shutdown-time, RINGTRAIN_STALL_SHUTDOWN_S, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)."
    ), error
    assert waited < 7.0, waited


def test_the_stall_shutdown_time_ends_no_wait_where_every_rank_waits() -> None:
    # Every member waits in this step (a slow exchange): nothing to end, however long.
    store = dist.HashStore()
    store.set("p/waiting/1", "3")
    watch = WaitWatch(store, "p", 0, [0, 1], warning_s=0.2, timeout_s=300.0, shutdown_s=0.2)
    watch.begin(3)
    time.sleep(2.0)
    watch.check()  # does not raise
    store.delete_key("p/waiting/1")  # rank 1 is elsewhere from now on
    _wait_for(lambda: watch._stall != "", within=5.0)
    with pytest.raises(StallError, match="ranks \\[1\\] are not waiting in step"):
        watch.check()
    watch.end()
    watch.close()


def _one_rank_in_a_collective() -> str:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    try:
        for step in range(2):
            if step == 1 and rt.rank() == 1:  # a metric only this rank reduces: a script's bug
                rt.allreduce(torch.ones(1), name="metric")
            opt.zero_grad()
            F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
            opt.step()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def test_a_wait_names_the_collective_a_rank_waits_in_instead(world2: World) -> None:
    # Rank 1 waits in an allreduce rank 0 never calls, rank 0 in step(): rank 0's error names
    # the collective (rank 1's controller posts it), not "not waiting in step()".
    error, other = world2.run(
        _one_rank_in_a_collective, stall_warning_s=1.0, stall_shutdown_s=6.0, timeout_s=4.0,
        timeout=60,
    )  # fmt: skip
    assert error.startswith("StallError: step() gave up after "), error
    assert "rank 1 waits in collective 'metric' (process set 0), not in step()" in error, error
    assert "not waiting in step()" not in error, error
    assert other.startswith(("StallError", "PeerFailedError")), other  # and rank 1's ends too


JOIN_A_STEP_SHORT = """
import torch
import torch.nn.functional as F
import ringtrain.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
    overlap={overlap},
)
for _ in range({steps} if hvd.rank() == 0 else 2):
    opt.zero_grad()
    F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
    opt.step()
print("joined, last", hvd.join(), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_join_does_not_stand_in_for_step_and_says_so_at_once(
    tmp_path: Path, overlap: bool, request: pytest.FixtureRequest
) -> None:
    """Rank 1's data runs out a step early and it joins, Horovod's pattern for uneven data:
    join() contributes zeros to explicit allreduces, not to step()'s exchange, so rank 0 would
    wait in step 3 until the transport timeout (60 s here). Rank 1 reads rank 0's post and
    raises; its exit ends rank 0's wait with its words. With as many steps, join() is harmless.
    With overlap=True rank 0 waits in the updater thread, which posted nothing: the job hung
    until the transport timeout (before its wait was watched as step()'s)."""
    script = tmp_path / "job.py"
    run = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--timeout", "60"]
    run += ["--stall-warning-time", "1", "--", sys.executable, str(script)]
    script.write_text(JOIN_A_STEP_SHORT.format(steps=3, overlap=overlap))
    t0 = time.monotonic()
    done = subprocess.run(run, capture_output=True, text=True, timeout=100)
    assert done.returncode == 1 and time.monotonic() - t0 < 45, done.stderr
    report = done.stderr[done.stderr.index("ringtrain run: job failed") :]
    assert report.startswith("ringtrain run: job failed: rank 1 "), report
    assert (
        "CollectiveUnsupportedError: join() cannot stand in for DistributedOptimizer.step(): "
        "rank 0 waits in step() for the gradients of step 3, and this rank joined after 2 "
        "step(s); it would wait until the transport timeout." in report
    ), report
    assert "ringtrain.errors.PeerFailedError: rank 0: a peer left the job: rank 1" in report
    if overlap:
        return
    # The same script with as many steps on both ranks, in an in-process world (the launcher
    # is not what this shows): no error on either rank, and join() names the last to join.
    # (The world is asked for here, not in the signature: the overlap case starts none.)
    world2: World = request.getfixturevalue("world2")
    last = world2.run(_steps_then_join, 2)
    assert len(last) == 2 and last[0] == last[1] and last[0] in (0, 1), last


def _steps_then_join(steps: int) -> int:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
        opt.step()
    return int(rt.join())


def _one_rank_away_from(where: str, away_s: float) -> tuple[str, str, float, str]:
    """Rank 1 stays away ``away_s`` before its second step; rank 0 waits in ``where``: the
    updater of an overlapped step (``overlap``: the next forward raises) or local updates'
    outer exchange (``local``: step() raises). Rank 0's error, where it came, when, and the
    stall warnings said before."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    kind = {"overlap": {"overlap": True}, "local": {"sync_every": 2}}[where]
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        **kind,  # type: ignore[arg-type]
    )
    start, at, error = time.monotonic(), "step", ""
    with _warnings() as records:
        try:
            _away_steps(opt, model, away_s)
            at = "forward"
            model(torch.randn(4, 8))  # the next forward waits for an overlapped step's update
            at = ""
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    said = "\n".join(r for r in records if "has waited" in r)
    return error, at, time.monotonic() - start, said


def _away_steps(opt: Any, model: torch.nn.Module, away_s: float) -> None:
    for step in range(2):
        if step == 1 and rt.rank() == 1:
            time.sleep(away_s)  # stuck outside step(), in data loading, say
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
        opt.step()


@pytest.mark.parametrize(
    ("where", "at", "waits_for"),
    [
        ("overlap", "forward", "the gradients of step 2"),
        ("local", "step", "the outer exchange of local updates (sync_every=2)"),
    ],
)
def test_a_background_wait_is_watched_as_a_step(
    world2: World, where: str, at: str, waits_for: str
) -> None:
    # overlap=True: step() returns at once and the updater thread waits for the peers; local
    # updates (sync_every): step() waits for the outer exchange on the group's worker. Both
    # waited silently until the transport timeout (30 s here) and then raised Gloo's bare
    # "Timed out waiting ... for recv". Now, as a synchronous step()'s wait: a warning naming
    # rank 1 past the warning time, and a StallError naming it past the shutdown time, raised
    # where the rank next waits (the next forward for overlap).
    (error, where_, took, said), _ = world2.run(
        _one_rank_away_from, where, 9.0, stall_warning_s=1.0, stall_shutdown_s=2.0,
        timeout_s=30.0, timeout=90,
    )  # fmt: skip
    assert (
        error.startswith("StallError: step() gave up after ")
        and f" s, past the stall shutdown time, for {waits_for}; ranks [0] wait there.\n" in error
    ), error
    assert "ranks [1] are not waiting in step()" in error, error
    assert error.endswith("(--stall-shutdown-time, RINGTRAIN_STALL_SHUTDOWN_S, "
                          "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)."), error  # fmt: skip
    assert where_ == at and took < 20.0, (where_, took)  # not the transport timeout (30 s)
    assert said.startswith(f"ringtrain: step() has waited 1 s for {waits_for}"), said
    assert "ranks [1] are not waiting in step()" in said, said
