"""One process per rank, one world size, one job (runtime.seats): a process given a rank that
another holds, or started for another world size or job, is refused at once by name, and the
job it met goes on, instead of both failing in Gloo's first connection or at the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from _hang_report import left_behind, tagged
from ringtrain.config import Config
from ringtrain.errors import LaunchEnvironmentError, MissingRanksError
from ringtrain.launch.rendezvous import free_port
from ringtrain.runtime import arrivals, seats
from ringtrain.runtime.environment import Placement

JOB = Path(__file__).with_name("seats_job.py")
WHERE = "10.0.0.1:29500"


def _world() -> dist.Store:
    return dist.PrefixStore("ringtrain/gen1", dist.HashStore())


def _ranks(store: dist.Store, calls: list[dict[str, object]]) -> list[BaseException | None]:
    """``wait_for_all(store, **call)`` for each call on a thread of its own, all at once."""
    out: list[BaseException | None] = [None] * len(calls)

    def rank(i: int) -> None:
        try:
            arrivals.wait_for_all(store, where=WHERE, **calls[i])  # type: ignore[arg-type]
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_a_second_process_given_a_rank_is_refused_and_the_world_forms() -> None:
    out = _ranks(
        _world(),
        [{"rank": 0, "size": 2, "timeout_s": 30}] + [{"rank": 1, "size": 2, "timeout_s": 30}] * 2,
    )
    assert out[0] is None and sorted(e is None for e in out[1:]) == [False, True], out
    (refused,) = [e for e in out if e is not None]
    assert isinstance(refused, LaunchEnvironmentError)
    assert str(refused).startswith(
        f"rank 1: another process already holds rank 1 at {WHERE} (pid {os.getpid()} on "
    ), refused
    assert "HINT: give each process of a job its own RANK, 0 to 1;" in str(refused)


def test_a_rank_started_for_another_world_size_is_refused_before_it_takes_a_seat() -> None:
    store = _world()
    wrong, right = _ranks(
        store, [{"rank": 2, "size": 3, "timeout_s": 30}, {"rank": 0, "size": 2, "timeout_s": 2}]
    )
    assert isinstance(wrong, LaunchEnvironmentError), wrong
    assert str(wrong).startswith(
        f"rank 2: this rank was started for a world of 3 ranks, but rank 0 at {WHERE} for a "
        "world of 2.\nHINT: start every rank of a job with the same world size"
    ), wrong
    assert not store.check([arrivals.PREFIX + "2"])  # it wrote nothing there
    assert isinstance(right, MissingRanksError)  # rank 1 never came (a launcher would say why)


def test_a_rank_of_another_job_is_refused_and_one_without_a_job_id_is_not() -> None:
    calls: list[dict[str, object]] = [
        {"rank": 0, "size": 3, "timeout_s": 30, "job": "mpirun 7"},
        {"rank": 1, "size": 3, "timeout_s": 30, "job": "mpirun 8"},
        {"rank": 1, "size": 3, "timeout_s": 30, "job": ""},  # a launcher that names none
        {"rank": 2, "size": 3, "timeout_s": 30, "job": "mpirun 7"},
    ]
    other, *rest = _ranks(_world(), [calls[1], calls[0], calls[2], calls[3]])
    assert rest == [None, None, None], rest
    assert isinstance(other, LaunchEnvironmentError)
    assert str(other).startswith(
        f"rank 1: the rendezvous at {WHERE} is another job's (rank 0 there is of mpirun 7; "
        "this rank is of mpirun 8).\nHINT: give each job its own rendezvous port"
    ), other


def test_init_takes_the_job_id_from_the_launchers_variables() -> None:
    """What init() calls (``world_store``) reads the job id from the launcher's variables, as
    :func:`ringtrain.runtime.environment.job_id` names it: a rank of another mpirun job is
    refused before it takes a seat."""
    base = dist.HashStore()
    store = dist.PrefixStore("ringtrain/gen1", base)
    store.set(seats.WORLD, json.dumps({"size": 2, "job": "mpirun 7"}))  # rank 0's, job 7's
    placed = Placement("openmpi", 1, 2, "127.0.0.1", 29500)
    env = {"OMPI_MCA_ess_base_jobid": "8"}
    with pytest.raises(LaunchEnvironmentError) as refused:
        arrivals.world_store("ringtrain/gen1", base, placed, Config(timeout_s=2), False, None, env)
    assert str(refused.value).startswith(
        "rank 1: the rendezvous at 127.0.0.1:29500 is another job's (rank 0 there is of mpirun "
        "7; this rank is of mpirun 8)."
    ), refused.value
    assert not store.check([arrivals.PREFIX + "1"])


def test_ranks_wait_for_rank_0s_world_before_they_take_a_seat() -> None:
    store = _world()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            arrivals.wait_for_all(store, r, 2, timeout_s=30)
        except BaseException as e:
            errors.append(e)

    early = threading.Thread(target=rank, args=(1,))
    early.start()
    time.sleep(0.5)
    assert not store.check([arrivals.PREFIX + "1"]) and not store.check([seats.WORLD])
    rank(0)
    early.join(30)
    assert errors == [] and not early.is_alive()
    assert seats.mode(bytes(store.get(arrivals.PREFIX + "1"))) == "1"


@pytest.mark.timeout(180)
def test_processes_started_by_hand_with_a_rank_taken_or_the_wrong_size(tmp_path: Path) -> None:
    """What users type: RANK, WORLD_SIZE and MASTER_ADDR/PORT by hand, one slip each. Two
    processes get RANK=1 and one WORLD_SIZE=3: the job of two forms with one of them, and the
    other two say why they cannot join, at once (before, a bare Gloo "Connection reset by
    peer" traceback, or a wait of timeout_s)."""
    base = tagged(
        {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_"))}
    )
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    hold = tmp_path / "release"  # the job stays open until the other two have met it
    base["SEATS_HOLD"] = str(hold)
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB)],
            env={**base, "RANK": str(rank), "WORLD_SIZE": str(size)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, size in [(0, 2), (1, 2), (1, 2), (1, 3)]
    ]
    try:
        while sum(p.poll() is not None for p in procs) < 2 and time.monotonic() - started < 150:
            time.sleep(0.1)
        hold.touch()
        done = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            p.kill()
    took = time.monotonic() - started
    codes = [p.returncode for p in procs]
    assert codes[0] == 0 and sorted(codes[1:3]) == [0, 1] and codes[3] == 1, done
    results = [json.loads(out) for (out, _), code in zip(done, codes) if code == 0]
    assert sorted((r["rank"], r["sum"]) for r in results) == [(0, 3.0), (1, 3.0)]
    holder = next(r["pid"] for r in results if r["rank"] == 1)
    refused = next(err for (_, err), code in zip(done[1:3], codes[1:3]) if code == 1)
    where = f"127.0.0.1:{base['MASTER_PORT']}"
    assert f"rank 1: another process already holds rank 1 at {where} (pid {holder} on " in refused
    assert "Connection reset by peer" not in refused, refused
    assert f"started for a world of 3 ranks, but rank 0 at {where} for a world of 2" in done[3][1]
    assert took < 120, took  # a refusal does not wait for timeout_s (300 s)
    assert left_behind(base) == []
