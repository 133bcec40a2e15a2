"""Authenticated rendezvous: ranks prove the key to each other; a stranger is turned away with a
clear error and the job goes on; a real rank with the wrong key fails clearly on every rank."""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch

import ringtrain as rt
from ringtrain.errors import SecurityError
from ringtrain.security import keys, rendezvous
from ringtrain.testing.spawn import RankFailed, World


def _store() -> Any:
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )


def _run(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(fn(*args))
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=go)
    t.start()
    return t, out


def test_ranks_with_the_key_are_admitted() -> None:
    store, key = _store(), keys.generate_job_key()
    runs = [_run(rendezvous.authenticate, store, key, "job", r, 3, f"h{r}", 20) for r in range(3)]
    for t, _ in runs:
        t.join(30)
    assert [out for _, out in runs] == [[None]] * 3


def test_a_stranger_is_turned_away_and_the_job_goes_on() -> None:
    store, key = _store(), keys.generate_job_key()
    # the stranger claims rank 1 first, with its own key
    t_bad, bad = _run(
        rendezvous.authenticate, store, keys.generate_job_key(), "job", 1, 2, "evil", 20
    )
    t0, out0 = _run(rendezvous.authenticate, store, key, "job", 0, 2, "h0", 20)
    t_bad.join(30)
    assert isinstance(bad[0], SecurityError)
    assert "could not verify rank 0's proof" in str(bad[0]) and "HINT" in str(bad[0])
    # rank 0 is still waiting for the real rank 1, which then joins
    assert t0.is_alive()
    t1, out1 = _run(rendezvous.authenticate, store, key, "job", 1, 2, "h1", 20)
    t0.join(30)
    t1.join(30)
    assert out0 == [None] and out1 == [None]


def test_at_the_timeout_a_waiting_rank_fails_with_rank_0s_message() -> None:
    """Rank 1 is admitted and waits for rank 2; a stranger claims rank 2 from host "evil". At
    rank 0's timeout, rank 0 and the waiting rank 1 give the same message: the missing rank and
    the rejected attempt with its host. (Rank 1's own timeout is longer here, so that rank 0's
    comes first; a waiting rank whose own timeout passes first says rank 0 never answered.)"""
    store, key = _store(), keys.generate_job_key()
    t0, out0 = _run(rendezvous.authenticate, store, key, "job", 0, 3, "h0", 3)
    t1, out1 = _run(rendezvous.authenticate, store, key, "job", 1, 3, "h1", 30)
    t_bad, bad = _run(
        rendezvous.authenticate, store, keys.generate_job_key(), "job", 2, 3, "evil", 30
    )
    for t in (t0, t1, t_bad):
        t.join(40)
    assert not any(t.is_alive() for t in (t0, t1, t_bad))
    assert isinstance(bad[0], SecurityError) and "(host evil)" in str(bad[0])
    why = "ranks [2] did not prove they hold the job key within 3 s; rejected attempts: rank 2 "
    why += "from host evil: its proof of the job key did not verify (wrong key)"
    for out in (out0, out1):
        assert isinstance(out[0], SecurityError)
        assert str(out[0]).startswith(why), str(out[0])


def test_the_job_prefix_needs_the_key() -> None:
    key = keys.generate_job_key()
    assert rendezvous.job_prefix(key, "j") == rendezvous.job_prefix(key, "j")
    assert rendezvous.job_prefix(key, "j") != rendezvous.job_prefix(keys.generate_job_key(), "j")
    assert key.hex()[:16] not in rendezvous.job_prefix(key, "j")


def _sum() -> float:
    return float(rt.allreduce(torch.ones(1), op=rt.Sum).item())


def test_a_rank_with_the_wrong_key_fails_clearly_on_every_rank(
    world2: World, key_file: str, tmp_path: Any
) -> None:
    other = keys.write_key_file(tmp_path / "other.key", keys.generate_job_key())
    envs = [
        {"RINGTRAIN_KEY_FILE": key_file, "RINGTRAIN_HOSTNAME": "node-a"},
        {"RINGTRAIN_KEY_FILE": other, "RINGTRAIN_HOSTNAME": "node-b"},
    ]
    with pytest.raises(RankFailed) as info:
        world2.run(_sum, env=envs, timeout=60, secure=True, timeout_s=5)
    msg = str(info.value)
    rank0, rank1 = msg.split("--- rank 1 ---")
    # rank 1 fails at once, on rank 0's proof; rank 0 at the timeout, naming the attempt's host
    assert "SecurityError" in rank1 and "could not verify rank 0's proof" in rank1
    assert "rank 1 (host node-b)" in rank1
    assert "SecurityError" in rank0 and "ranks [1] did not prove" in rank0
    assert "rejected attempts: rank 1 from host node-b: " in rank0
    assert "wrong key" in rank0  # rank 0 saw and rejected the attempt
    # the same ranks with the same key work
    assert world2.run(_sum, secure=True, key_file=key_file) == [2.0, 2.0]


def test_a_rank_started_without_secure_mode_is_named_at_once(world2: World, key_file: str) -> None:
    """A wrapper dropped secure mode for rank 1: both ranks fail within seconds naming it, not
    after the timeout with "did not prove they hold the job key"."""
    envs = [{"RINGTRAIN_SECURE": "1", "RINGTRAIN_KEY_FILE": key_file}, {}]
    with pytest.raises(RankFailed) as info:
        world2.run(_sum, env=envs, timeout=60, timeout_s=120)
    for part in str(info.value).split("--- rank 1 ---"):
        assert "SecurityError" in part and "1 of 2 ranks started in secure mode" in part, part
        assert "rank(s) 0: secure\n  rank(s) 1: not secure" in part
