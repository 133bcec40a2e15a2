"""A rank that leaves while rank 0's background saves are in flight: rank 0 gives up each save
that lacks its part within seconds (not the transport timeout), saying so in one line, leaves
it uncommitted as a crash would, and still commits a save whose parts were all written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from _launcher_runs import assert_gone, finish
from ringtrain.checkpoint import layout, manifest, peers, store
from ringtrain.launch.failures import exited_key
from ringtrain.runtime import departures
from ringtrain.runtime.departures import FAILED, FINISHED, Departure

pytestmark = pytest.mark.timeout(180)
JOB = str(Path(__file__).with_name("peer_left_job.py"))
# Before: rank 0 waited out --timeout (60 s here) for the missing part, at close() and at exit.
# Giving up takes a read of the departures (each second), timed to the end of rank 0's at-exit
# work (which gives up the save left open): the interpreter's and the launcher's wind-down after
# it, which took 17 s once beside stress-ng under torchrun, say nothing of it.
GIVES_UP_WITHIN_S = 15.0


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# How rank 0 names rank 1, which left with os._exit(0): `ringtrain run` records its exit; under
# torchrun, which records none, rank 0 finds its process ended (both run on this machine).
# Under torchrun, rank 0 found rank 1's process ended on its machine (this one) and posted so.
NAMED = {
    "ringtrain": "(rank 1 exited ",
    "torchrun": f"(rank 1 (host {socket.gethostname()}) ended without a word (os._exit, ",
}


@pytest.mark.parametrize("launcher", list(NAMED))
def test_saves_a_departed_rank_never_wrote_are_given_up(tmp_path: Path, launcher: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if launcher == "ringtrain":
        argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--timeout", "60", "--"]
        argv += [sys.executable, JOB, str(tmp_path)]
    else:
        env["RINGTRAIN_TIMEOUT_S"] = "60"
        argv = [TORCHRUN, "--nproc-per-node", "2", "--monitor-interval", "0.5"]
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", JOB, str(tmp_path)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    code, err = finish(proc, timeout=90)
    took = float((tmp_path / "done_at").read_text()) - float((tmp_path / "left_at").read_text())
    assert code == 0, err  # both ranks ended with 0: rank 0 caught the collective's error
    assert took < GIVES_UP_WITHIN_S, err
    for name in ("a", "b"):  # closed by `with`, and at exit
        given_up = f"ringtrain: gave up the save into {tmp_path / name / 'step-000000002'}: "
        assert f"{given_up}rank 1 left the job before writing its part {NAMED[launcher]}" in err
        assert [s for s, _ in manifest.committed(str(tmp_path / name))] == [1]
        left = [n for n in os.listdir(tmp_path / name) if ".partial-" in n]
        assert len(left) == 1 and manifest.MANIFEST not in os.listdir(tmp_path / name / left[0])
    assert [s for s, _ in manifest.committed(str(tmp_path / "c"))] == [1, 2], err
    assert err.count("gave up") == 2, err
    pids = [int(p) for r in (0, 1) for p in (tmp_path / f"pids-{r}").read_text().split()]
    assert_gone(pids)


def _part(job: store.Job, rank: int) -> None:
    """Rank ``rank``'s part record of ``job``, as its writer leaves it."""
    record = {"rank": rank, "file": layout.data_file(rank), "sha256": "", "nbytes": 0}
    with open(os.path.join(job.partial, layout.part_file(rank)), "w") as f:
        json.dump({"save_id": job.save_id, "record": {**record, "entries": []}}, f)


def test_the_word_that_a_rank_left_and_what_the_writer_makes_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no launcher records exits (torchrun, elastic worlds), a posted failure is the
    word: the failing rank ends within seconds, its writer with it, so rank 0 notes it once the
    post has settled. A rank that posted only that it finished may still be writing in its
    at-exit work: noted once its exit is recorded. A part that came in the end commits."""
    base = dist.HashStore()
    world = dist.PrefixStore("ringtrain/world", base)  # the ranks' store; the launcher's: base
    world.set(departures.PREFIX + "1", Departure(1, FAILED, "ValueError: boom", "h", 1.0).encode())
    world.set(departures.PREFIX + "2", Departure(2, FINISHED, "at exit", "h", 1.0).encode())
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: False)
    monkeypatch.setattr(peers, "EVERY_S", 0.0)
    final = tmp_path / "step-000000002"
    partial = tmp_path / ".step-000000002.partial-x-2"
    job = store.Job(str(final), str(partial), "x-2", 0, 3, 2, 0, 60.0, {})
    os.makedirs(partial)
    _part(job, 0)
    lookout = peers.Lookout(job, peers.Departed(world))
    lookout.look()
    assert not os.path.exists(partial / layout.left_file(1))  # not settled yet
    monkeypatch.setattr(peers, "FAILING_SETTLE_S", 0.0)
    lookout.look()
    assert (partial / layout.left_file(1)).read_text() == "rank 1 (host h) failed: ValueError: boom"
    assert not os.path.exists(partial / layout.left_file(2))
    with pytest.raises(store.SaveGivenUp) as given_up:
        store._records(job)  # at once: rank 2 would be waited for, but rank 1 is gone
    assert str(given_up.value) == (
        f"gave up the save into {final}: rank 1 left the job before writing its part (rank 1 "
        f"(host h) failed: ValueError: boom). It stays uncommitted in {partial}, as after a "
        "crash; earlier checkpoints are untouched."
    )
    base.set(exited_key(2), "exited with code 0")
    monkeypatch.setattr(departures, "_launcher_records_exits", lambda: True)
    lookout.look()
    assert (partial / layout.left_file(2)).read_text() == "rank 2 exited with code 0"
    _part(job, 1)  # written before rank 1's process ended after all
    _part(job, 2)
    assert [r.rank for r in store._records(job)] == [0, 1, 2]
