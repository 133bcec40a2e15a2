"""A rank its peers wait for says where its threads are (diagnostics/whereabouts.py).

The pure parts with plain values; the threads of this process as the controller reads them;
and a real job under ``ringtrain run``, whose rank 1 is stuck in its data source while rank 0
waits in an allreduce.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ringtrain.collectives.doorbell import Doorbell
from ringtrain.diagnostics import whereabouts
from ringtrain.diagnostics.stall import Waiting


def test_only_names_this_rank_has_not_submitted_and_that_waited_long_enough() -> None:
    waiting = {
        "late": Waiting("late", (0, 2), 10.0),
        "mine": Waiting("mine", (1,), 5.0),  # rank 1 submitted it: others keep it waiting
        "fresh": Waiting("fresh", (0,), 69.5),
        "older": Waiting("older", (0,), 2.0),
    }
    got = whereabouts.stalled_here(waiting, 1, 60.0, now=70.0)
    assert [w.name for w in got] == ["older", "late"]  # oldest first
    assert whereabouts.stalled_here(waiting, 0, 60.0, now=70.0) == [waiting["mine"]]


def test_the_report_names_world_ranks_the_set_and_each_thread() -> None:
    stalled = [Waiting("grad.fc", (0,), 10.0)]
    threads = [("MainThread", ['    File "train.py", line 9, in load', "      time.sleep(1)"])]
    said = whereabouts.report(5, stalled, 70.0, [3, 5], threads, set_id=2)
    assert said.startswith(
        "rank 5 keeps its peers waiting on process set 2: it has not submitted 'grad.fc' "
        "(60 s; submitted by ranks [3])."
    ), said
    assert '  thread MainThread:\n    File "train.py", line 9, in load\n' in said
    assert "HINT:" in said
    again = whereabouts.report(5, stalled, 130.0, [3, 5], threads, set_id=2, same_as_last=True)
    assert "\n" not in again and again.endswith("still where its last report showed them.")
    many = [Waiting(f"n{i}", (0,), 1.0) for i in range(7)]
    assert "'n4' (69 s; submitted by ranks [3]) and 2 more." in whereabouts.report(
        5, many, 70.0, [3, 5], threads
    )


def _load_batch(stop: threading.Event) -> None:
    stop.wait()  # a data source that does not answer


def _in_ringtrain(stop: threading.Event) -> None:
    Doorbell(None, 0, 1).settled(30.0, stop.is_set)  # blocked in a ringtrain call


def _runs_a_loop(loops: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[None]]]) -> None:
    async def idle() -> None:
        task = asyncio.current_task()
        assert task is not None
        loops.append((asyncio.get_running_loop(), task))
        await asyncio.sleep(60)

    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(idle())  # deep in the standard library, waiting in select()


def test_a_long_run_of_library_frames_folds_and_the_users_own_frame_shows() -> None:
    loops: list[tuple[asyncio.AbstractEventLoop, asyncio.Task[None]]] = []
    thread = threading.Thread(target=_runs_a_loop, args=(loops,), name="looper")
    thread.start()
    try:
        while not loops:
            time.sleep(0.01)
        time.sleep(0.2)  # in select() by now
        lines = dict(whereabouts.threads_now())["looper"]
    finally:
        loop, task = loops[0]
        loop.call_soon_threadsafe(task.cancel)
        thread.join()
    said = "\n".join(lines)
    assert lines[0].endswith(", in _runs_a_loop"), said  # not threading's bootstrap
    assert "asyncio.run(idle())" in said, said
    assert any(
        line.startswith("      ... ") and "more frames in libraries" in line for line in lines
    ), said
    assert "in run\n" in said  # where the user's call entered the libraries
    assert lines[-2].endswith(", in select"), said  # and where it waits


def test_threads_now_shows_the_users_threads_main_first_and_folds_ringtrain_frames() -> None:
    stop = threading.Event()
    threads = [
        threading.Thread(target=_load_batch, args=(stop,), name="loader"),
        threading.Thread(target=_in_ringtrain, args=(stop,), name="waiter"),
        threading.Thread(target=_load_batch, args=(stop,), name="ringtrain-own"),
    ]
    for t in threads:
        t.start()
    try:
        got = dict(whereabouts.threads_now())
        names = list(dict(whereabouts.threads_now()))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert names[0] == "MainThread"
    assert "ringtrain-own" not in got  # ringtrain's own threads are not where the user is
    loader = "\n".join(got["loader"])
    assert "in _load_batch\n" in loader and "stop.wait()  # a data source" in loader, loader
    waiter = got["waiter"]
    assert "in _in_ringtrain" in waiter[-3], waiter
    assert waiter[-1].startswith("      (inside ringtrain: collectives/doorbell.py:"), waiter
    assert waiter[-1].endswith(", in settled)"), waiter
    assert len(loader.splitlines()) <= 2 * whereabouts.FRAMES_SHOWN


@dataclass
class _Member:
    set_rank: int = 1
    set_id: int = 0
    ranks: tuple[int, ...] = (0, 1)


def test_a_report_per_warning_time_and_none_when_the_inspector_is_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = {"loss": Waiting("loss", (0,), 0.0)}

    def waiting(now: float, for_s: float) -> dict[str, Waiting]:
        return {n: w for n, w in table.items() if now - w.since >= for_s}

    stacks = [("MainThread", ['    File "t.py", line 3, in f'])]
    where = whereabouts.Whereabouts(_Member(), 60.0, 600.0, threads=lambda: stacks)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        assert where.look(waiting, 30.0) == ""  # not yet
        first = where.look(waiting, 60.5)
        assert first.startswith("rank 1 keeps its peers waiting: it has not submitted 'loss'")
        assert where.look(waiting, 100.0) == ""  # once per warning time
        again = where.look(waiting, 121.0)
        assert again.endswith("still where its last report showed them.")
    assert [r.getMessage() for r in caplog.records] == [first, again]  # logged at WARNING
    # A shutdown time sooner than the warning time: first at half of it, before the job stops.
    soon = whereabouts.Whereabouts(_Member(), 60.0, 10.0, threads=lambda: stacks)
    assert soon.look(waiting, 4.0) == "" and soon.look(waiting, 5.5).startswith("rank 1 keeps")
    off = whereabouts.Whereabouts(_Member(), 0.0, threads=lambda: stacks)
    assert off.look(waiting, 1e6) == ""
    submitted = whereabouts.Whereabouts(_Member(set_rank=0), 60.0, threads=lambda: stacks)
    assert submitted.look(waiting, 1e6) == ""  # rank 0 submitted it: others keep it waiting


STUCK = """\
import time, torch, ringtrain.torch as hvd
hvd.init()

def load_batch(step):
    if hvd.rank() == 1 and step == 3:
        time.sleep(6)  # a data source that takes its time
    return torch.ones(1000)

for step in range(5):
    hvd.allreduce(load_batch(step), name="loss")
"""


@pytest.mark.timeout(120)
def test_under_ringtrain_run_the_rank_that_keeps_its_peers_waiting_says_where(
    tmp_path: Path,
) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--stall-warning-time", "2"]
    argv += ["--", sys.executable, str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=100)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "[0]   rank 1 has not submitted: 'loss'" in out, out  # rank 0's stall warning
    assert "a missing rank still running logs where its threads are" in out
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "rank 1 keeps its peers waiting" in line)
    assert lines[first].startswith("[1] rank 1 keeps its peers waiting: it has not submitted "), out
    told = "\n".join(lines[first : first + 8])
    assert "[1]   thread MainThread:" in told, told
    assert f'[1]     File "{script}", line 6, in load_batch' in told, told
    assert "[1]       time.sleep(6)  # a data source that takes its time" in told, told
    assert "rank 0 keeps its peers waiting" not in out  # rank 0 waited; it kept no one


class _Store:
    """The few calls of the job's store that Away makes, on a dict."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value.encode()

    def delete_key(self, key: str) -> bool:
        return self.keys.pop(key, None) is not None


def test_out_of_step_a_rank_looks_after_half_the_warning_time_and_answers_once() -> None:
    store = _Store()
    stacks = [("MainThread", ['    File "t.py", line 3, in load'])]
    away = whereabouts.Away(store, "e/where/1", 1, 60.0, threads=lambda: stacks)
    assert away.due() is None  # no step yet
    away.began(3)
    away.ended(100.0)
    assert away.due() == 130.0  # steps quicker than that never look
    away.looking(130.0)
    assert away.due() == 145.0
    assert away.look() == ""  # nobody asked
    store.set("e/where/1", "4:[0, 2]")  # as engine_wait's report asks
    said = away.look()
    assert said.startswith(
        "rank 1 keeps its peers waiting in step(): ranks [0, 2] wait there for the gradients of "
        "step 4, and this rank is not in step() (the last step it began: 3).\n"
        "Where its threads are now (most recent call last):\n  thread MainThread:\n"
    ), said
    assert not store.keys  # answered once
    away.began(4)
    assert away.due() is None  # in a wait: the watch's own report covers it
    off = whereabouts.Away(store, "e/where/1", 1, 0.0)
    off.ended(1.0)
    assert off.due() is None  # the inspector is off
