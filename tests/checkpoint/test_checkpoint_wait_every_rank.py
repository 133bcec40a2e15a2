"""``Checkpointer.wait()`` on every rank returns once rank 0 committed the save, as the blocking
``save()`` does: a rank other than 0 learns rank 0's outcome from the save's directories
(``store.verdict``), and is told when rank 0's commit failed, was given up, or never came."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import layout, manifest, peers, store
from ringtrain.errors import CheckpointError
from ringtrain.runtime import departures
from ringtrain.runtime.departures import FAILED, Departure
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(300)


def _late_rank_0(root: str, writer: str) -> tuple[str | None, bool]:
    """Rank 0 starts its save of step 2 late, so its commit comes well after rank 1's part.
    Returns what wait() returned and whether that checkpoint was committed when it did."""
    model = torch.nn.Linear(64, 64)
    with ckpt.Checkpointer(root, writer=writer) as saver:
        saver.save(1, model=model)  # the first save agrees on the save ids (a collective)
        saver.wait()
        if rt.rank() == 0:
            time.sleep(1.5)
        saver.save(2, model=model)
        path = saver.wait()
        assert path is not None
        with open(os.path.join(path, manifest.MANIFEST)) as f:
            committed = json.load(f)["step"] == 2
        return path, committed


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_wait_returns_on_every_rank_once_rank_0_committed(
    tmp_path: Path, world2: spawn.World, writer: str
) -> None:
    got = world2.run(_late_rank_0, str(tmp_path), writer)
    assert got == [(str(tmp_path / manifest.step_name(2)), True)] * 2


def _commit_refused(root: str) -> str:
    """Step 2 of another run is in ``root``: this run's save of step 2 writes every part, then
    rank 0's commit refuses to replace it. Returns what this rank's wait() raised."""
    model = torch.nn.Linear(16, 16)
    with ckpt.Checkpointer(root, run="other", writer="thread") as saver:
        saver.save(2, model=model)
    saver = ckpt.Checkpointer(root, run="mine", writer="thread")
    try:
        saver.save(2, model=model)
        saver.wait()
    except CheckpointError as e:
        return str(e)
    finally:
        saver.close()
    return ""


def test_a_commit_that_failed_is_raised_on_every_rank(tmp_path: Path, world2: spawn.World) -> None:
    said = world2.run(_commit_refused, str(tmp_path))
    assert "already holds a checkpoint of another run" in said[0], said
    assert (
        f"the background save into {tmp_path / manifest.step_name(2)} failed: rank 0 did not "
        "commit the save into"
    ) in said[1], said
    assert "HINT: rank 0 raises its error, which says why" in said[1]
    assert manifest.run_of(str(tmp_path / manifest.step_name(2))) == "other"


def _job(tmp_path: Path, rank: int, size: int = 3, timeout_s: float = 60.0) -> store.Job:
    final = tmp_path / "step-000000002"
    partial = tmp_path / ".step-000000002.partial-x-2"
    os.makedirs(partial, exist_ok=True)
    return store.Job(str(final), str(partial), "x-2", rank, size, 2, 0, timeout_s, {})


def _part(job: store.Job, rank: int) -> None:
    record = {"rank": rank, "file": layout.data_file(rank), "sha256": "", "nbytes": 0}
    with open(os.path.join(job.partial, layout.part_file(rank)), "w") as f:
        json.dump({"save_id": job.save_id, "record": {**record, "entries": []}}, f)


def test_a_save_given_up_is_rank_0s_word_to_the_others(tmp_path: Path) -> None:
    """Rank 2 left before writing its part: rank 0's writer gives the save up and leaves its
    words in the save's directory, where rank 1 (whose part is in) reads them."""
    job = _job(tmp_path, rank=0)
    _part(job, 0)
    _part(job, 1)
    Path(job.partial, layout.left_file(2)).write_text("rank 2 exited with code 0")
    with pytest.raises(store.SaveGivenUp) as given_up:
        store.commit(job, None)
    assert store.verdict(_job(tmp_path, rank=1)) == (store.GIVEN_UP, str(given_up.value))
    assert peers.await_commit(_job(tmp_path, rank=1)) == (store.GIVEN_UP, str(given_up.value))


def test_a_rank_0_that_left_is_a_save_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 failed with the save in flight: its writer never commits, and rank 1's wait ends
    once rank 0's departure has settled, not after timeout_s."""
    world = dist.PrefixStore("ringtrain/world", dist.HashStore())
    world.set(departures.PREFIX + "0", Departure(0, FAILED, "ValueError: boom", "h", 1.0).encode())
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: False)
    monkeypatch.setattr(peers, "EVERY_S", 0.0)
    monkeypatch.setattr(peers, "FAILING_SETTLE_S", 0.2)
    monkeypatch.setattr(peers.Departed, "of_world", staticmethod(lambda: peers.Departed(world)))
    job = _job(tmp_path, rank=1, size=2)
    _part(job, 1)
    t0 = time.monotonic()
    status, said = peers.await_commit(job)
    assert time.monotonic() - t0 < 30
    assert status == store.GIVEN_UP
    assert said == (
        f"the save into {job.final} was not committed: rank 0 left the job before committing it "
        f"(rank 0 (host h) failed: ValueError: boom). It stays uncommitted in {job.partial}, as "
        "after a crash; earlier checkpoints are untouched."
    )


def test_no_word_from_rank_0_within_the_timeout_is_an_error_that_says_why(
    tmp_path: Path,
) -> None:
    job = _job(tmp_path, rank=1, size=2, timeout_s=0.3)
    _part(job, 1)
    status, said = peers.await_commit(job)
    assert status == "error"
    assert said.startswith(f"rank 0 did not commit the save into {job.final} within 0.3 s")
    assert "\nHINT: rank 0 is stuck or gone" in said


def test_a_world_that_re_formed_does_not_wait_for_the_old_rank_0(tmp_path: Path) -> None:
    """A rank whose elastic world re-formed (or shut down) since its part of a save was written
    takes rank 0's word on it only if it is there: that world's rank 0 may be gone, and no
    departure of the world it is in now would say so. Before, close() waited timeout_s."""
    job = _job(tmp_path, rank=1, size=2, timeout_s=120.0)
    _part(job, 1)
    saver = ckpt.Checkpointer(tmp_path / "root", writer="thread")
    saver._unconfirmed, saver._world = job, (3, 2)  # this process is in world (0, 1)
    t0 = time.monotonic()
    assert saver.wait() is None
    assert time.monotonic() - t0 < 10
    assert saver._unconfirmed is None
    saver.close()
