"""Every rank's arrival in ``init()``: a rank that never calls it is named, at once when the
launcher saw it exit, else at ``timeout_s``, instead of a silent wait and torch's store error."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from _hang_report import left_behind, run_job, tagged
from ringtrain.errors import LaunchError, MissingRanksError, RingtrainError, SecurityError
from ringtrain.launch.failures import exited_key
from ringtrain.runtime import arrivals

JOB = Path(__file__).parent / "noinit_job.py"


def _world() -> tuple[dist.Store, dist.Store]:
    base = dist.HashStore()
    return dist.PrefixStore("ringtrain/gen1", base), base


def test_ranks_that_all_arrive_go_on() -> None:
    store, base = _world()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            time.sleep(0.05 * r)  # staggered, as real ranks are
            arrivals.wait_for_all(store, r, 3, timeout_s=30, records=base)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and not any(t.is_alive() for t in threads)


def test_ranks_of_mixed_modes_are_named_by_every_rank() -> None:
    """Rank 1 of 3 was started without secure mode: all three raise, naming it, as soon as all
    arrived (not at the timeout)."""
    store, base = _world()
    out: dict[int, BaseException | None] = {}

    def rank(r: int) -> None:
        try:
            arrivals.wait_for_all(store, r, 3, timeout_s=60, records=base, secure=r != 1)
            out[r] = None
        except BaseException as e:
            out[r] = e

    started = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert time.monotonic() - started < 10 and sorted(out) == [0, 1, 2]
    for r, e in out.items():
        assert isinstance(e, SecurityError), (r, e)
        assert str(e).startswith(
            f"rank {r}: 2 of 3 ranks started in secure mode, the others without it:\n"
            "  rank(s) 0, 2: secure\n  rank(s) 1: not secure\nHINT: start every rank"
        ), str(e)
    # All secure, or none: nothing to say.
    for secure in (True, False):
        store = dist.PrefixStore(f"gen-{secure}", base)
        threads = [
            threading.Thread(
                target=arrivals.wait_for_all, args=(store, r, 2, 30, base, None, secure)
            )
            for r in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert store.add(arrivals.SECURE_COUNT, 0) == (2 if secure else 0)


def test_a_rank_the_launcher_saw_exit_is_named_at_once() -> None:
    store, base = _world()
    base.set(exited_key(1), "exited with code 0")  # how `ringtrain run` records it
    started = time.monotonic()
    with pytest.raises(MissingRanksError) as info:
        arrivals.wait_for_all(store, 0, 2, timeout_s=60, records=base)
    assert time.monotonic() - started < 10
    text = str(info.value)
    assert text.startswith(
        "rank 0: rank 1 exited with code 0 before it called ringtrain.init(), so this rank's "
        "init() can never complete (1 of 2 ranks arrived)."
    )
    assert "\nHINT: every rank must call ringtrain.init()" in text
    assert info.value.ranks == (1,)
    assert isinstance(info.value, LaunchError) and isinstance(info.value, RingtrainError)


def test_ranks_that_never_arrive_are_named_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(arrivals, "SAY_AFTER_S", 0.2)
    store, base = _world()
    store.set(arrivals.PREFIX + "2", "1")  # rank 2 arrived; 1 and 3 never do
    with caplog.at_level(logging.WARNING, "ringtrain"), pytest.raises(MissingRanksError) as info:
        arrivals.wait_for_all(store, 0, 4, timeout_s=1.5, records=base)
    assert str(info.value).startswith(
        "rank 0: rank(s) [1, 3] did not call ringtrain.init() within timeout_s=1.5 s "
        "(2 of 4 ranks arrived).\nHINT: "
    )
    assert info.value.ranks == (1, 3)
    # The lowest waiting rank says who is missing while it waits.
    assert "init() is still waiting for rank(s) [1, 3]" in caplog.text


def test_the_lowest_waiting_rank_says_who_is_missing_again_while_it_waits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/launch.md: named after SAY_AFTER_S, then every SAY_EVERY_S (10 s and 30 s; shortened
    here), by the lowest rank that arrived only: rank 1 waits as long and says nothing."""
    monkeypatch.setattr(arrivals, "SAY_AFTER_S", 0.1)
    monkeypatch.setattr(arrivals, "SAY_EVERY_S", 0.6)
    monkeypatch.setattr(arrivals, "LOOK_EVERY_S", 0.05)
    store, base = _world()
    said: dict[int, list[float]] = {0: [], 1: []}

    def rank(r: int) -> None:
        with pytest.raises(MissingRanksError):
            arrivals.wait_for_all(store, r, 3, timeout_s=2.0, records=base)

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "is still waiting for rank(s) [2]" in record.getMessage():
                said[record.args[0]].append(time.monotonic())  # type: ignore[index]

    handler = Said()
    logging.getLogger("ringtrain").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, "ringtrain"):
            threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
    finally:
        logging.getLogger("ringtrain").removeHandler(handler)
    assert not any(t.is_alive() for t in threads)
    assert said[1] == []
    # 2 s of waiting: said at about 0.1, 0.7 and 1.3 s (at least twice on a loaded machine),
    # never twice within SAY_EVERY_S.
    assert len(said[0]) >= 2
    gaps = [b - a for a, b in zip(said[0], said[0][1:], strict=False)]
    assert min(gaps) >= 0.6


def test_in_a_big_world_each_look_reads_a_window_of_ranks_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A look reads at most LOOK_AT_MOST ranks' keys, so a rank far down the list that exited
    is still found, a few looks later."""
    monkeypatch.setattr(arrivals, "LOOK_EVERY_S", 0.05)
    store, base = _world()
    for r in range(1, 100):
        if r != 70:
            store.set(arrivals.PREFIX + str(r), "1")
            store.add(arrivals.COUNT, 1)
    base.set(exited_key(70), "was killed by SIGKILL")
    with pytest.raises(MissingRanksError, match=r"rank 70 was killed by SIGKILL before") as info:
        arrivals.wait_for_all(store, 0, 100, timeout_s=60, records=base)
    assert "(99 of 100 ranks arrived)" in str(info.value)


def test_long_lists_of_ranks_are_cut() -> None:
    assert arrivals._names([1, 5]) == "[1, 5]"
    assert arrivals._names(list(range(40)), most=3) == "[0, 1, 2, ...] (40 in all)"


def _run(mode: str, *flags: str) -> tuple[str, str, int]:
    env = tagged({**os.environ, "NOINIT": mode, "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "ringtrain", "run", "-np", "2", *flags, sys.executable, str(JOB)]
    proc = run_job(cmd, env, timeout=150, rank_marker=str(JOB))
    assert not (left := left_behind(env)), left
    return proc.stdout, proc.stderr, proc.returncode


@pytest.mark.timeout(200)
def test_a_rank_that_exits_before_init_fails_its_peers_init_at_once() -> None:
    # --timeout 120: only the launcher's exit record can end the wait within the test's time.
    out, err, rc = _run("exit0", "--timeout", "120")
    assert rc == 1, out + err
    assert "rank 0: rank 1 exited with code 0 before it called ringtrain.init()" in err
    assert "HINT: every rank must call ringtrain.init()" in err
    assert "DistStoreError" not in out + err and "[0] done" not in out


@pytest.mark.timeout(200)
def test_a_rank_that_never_calls_init_is_named_at_the_timeout() -> None:
    out, err, rc = _run("sleep", "--timeout", "5")
    assert rc == 1, out + err
    assert "rank 0: rank(s) [1] did not call ringtrain.init() within timeout_s=5 s" in err
    assert "HINT:" in err and "DistStoreError" not in out + err
