"""Elastic jobs under ``ringtrain run --min-np``: a rank SIGKILLed mid-epoch, the survivors
re-form the world in the same processes and finish with an undisturbed run's result."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _hang_report import run_job
from ringtrain.errors import ConfigError
from ringtrain.launch import elastic
from ringtrain.launch.hosts import Host
from ringtrain.launch.options import LaunchOptions

JOB = Path(__file__).parent / "elastic_job.py"
N, EPOCHS = 60, 2  # as in elastic_job.py
# (count, sum, sum of squares) of samples 1..N, each trained on once per epoch
EXPECTED = [N * EPOCHS, EPOCHS * N * (N + 1) // 2, EPOCHS * N * (N + 1) * (2 * N + 1) // 6]


def _job(
    *flags: str, victim: int, mode: str = "allreduce", kill: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VICTIM": str(victim), "OMP_NUM_THREADS": "1", "MODE": mode, "KILL": kill}
    cmd = [sys.executable, "-m", "ringtrain", "run", "-np", "3", *flags, sys.executable, str(JOB)]
    return run_job(cmd, env, timeout=240, rank_marker=str(JOB))


def _fields(out: str, kind: str) -> list[dict[str, str]]:
    return [
        dict(re.findall(r"(\w+)=(\S+)", line))
        for line in out.splitlines()
        if re.match(rf"\[\d+\] {kind} ", line)
    ]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("victim", "secure"), [(1, False), (0, True)], ids=["rank1", "rank0-secure"]
)
def test_survivors_resume_in_the_same_processes(victim: int, secure: bool) -> None:
    """One job checks both paths (``MODE=both``): ``w`` went through DistributedOptimizer,
    rebound to the new world, and ``sums`` through ``hvd.allreduce``.

    --secure (rank 0 killed; rank 1 across hosts in tests/cluster/test_elastic_cluster.py's
    secure survivors): the survivors authenticate a new rendezvous and make new sealed groups
    (fresh session keys) for the new world, with the same result. One job per victim: the
    victim and the transport are independent of each other here, so each job shows one of each
    (a job costs about 10 s of CPU)."""
    flags = ["--min-np", "2", "--elastic-timeout", "60", *(["--secure"] if secure else [])]
    proc = _job(*flags, victim=victim, mode="both")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = {s["id"]: s["pid"] for s in _fields(proc.stdout, "start")}
    done = _fields(proc.stdout, "done")
    survivors = sorted({"0", "1", "2"} - {str(victim)})
    assert sorted(d["id"] for d in done) == survivors
    for d in done:
        assert d["pid"] == pids[d["id"]]  # recovered in place, not restarted
        assert d["size"] == "2"
        assert d["w"] == str(EXPECTED).replace(" ", "")  # every sample exactly once
        assert d["sums"] == d["w"]
    # renumbered alike everywhere: the survivors keep their order as ranks 0 and 1
    assert sorted(int(d["rank"]) for d in done) == [0, 1]
    assert [d["id"] for d in sorted(done, key=lambda d: d["rank"])] == survivors
    (kill,) = _fields(proc.stdout, "kill")
    resets = _fields(proc.stdout, "reset")
    assert len(resets) == 2
    # The new world is sealed where the job is secure, and plain Gloo where it is not.
    assert all((r["backend"] == "ringtrain_sealed") == secure for r in resets), resets
    assert max(float(r["t"]) for r in resets) - float(kill["t"]) < 10.0
    assert f"re-forming the world with the 2 remaining rank(s) {[int(s) for s in survivors]}" in (
        proc.stderr
    )


@pytest.mark.timeout(300)
def test_local_updates_survive_a_membership_change() -> None:
    """Local updates (overlapped, in 2 fragments, exchanges in flight when rank 1 is killed):
    the survivors restore the committed state, start a new round on the new world, and end with
    the same anchor; the samples are each trained on once (the allreduce's sums)."""
    proc = _job("--min-np", "2", "--elastic-timeout", "60", victim=1, mode="local")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = _fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "2"]
    assert all(d["size"] == "2" and d["w"] == str(EXPECTED).replace(" ", "") for d in done)
    assert done[0]["anchor"] == done[1]["anchor"], done
    assert len(_fields(proc.stdout, "reset")) == 2


@pytest.mark.timeout(300)
def test_a_collective_failing_on_one_rank_alone_re_forms_the_same_ranks() -> None:
    """Rank 2's collective fails on its side alone (as when its own connection breaks) and no
    rank leaves: it asks the launcher, which, seeing no rank leave within the grace, re-forms
    the same 3 ranks as generation 1; the peers, waiting on rank 2 in the old world, leave it
    for the new one. Every rank rolls back to its last commit: every sample once. (A Ray job's
    rank waited so for 630 s for a world no event would bring.)"""
    proc = _job("--min-np", "2", "--elastic-timeout", "60", victim=2, kill="raise")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pids = {s["id"]: s["pid"] for s in _fields(proc.stdout, "start")}
    done = _fields(proc.stdout, "done")
    assert sorted(d["id"] for d in done) == ["0", "1", "2"], proc.stdout + proc.stderr
    for d in done:
        assert d["pid"] == pids[d["id"]] and d["size"] == "3" and d["rank"] == d["id"]
        assert d["w"] == str(EXPECTED).replace(" ", "")  # rolled back: every sample once
    assert len(_fields(proc.stdout, "reset")) == 3
    assert (
        "rank(s) [2] failed a collective while no rank had left the world; re-forming it with "
        "the same 3 rank(s) [0, 1, 2] (generation 1)" in proc.stderr
    ), proc.stderr
    err = proc.stderr.splitlines()
    assert any(
        x.startswith("[2] ringtrain elastic: rank 2: CollectiveAbortedError: a collective failed ")
        and "; re-forming: asked the launcher for a new world, waiting up to " in x
        for x in err
    ), proc.stderr
    for who in ("0", "1"):  # their waits on rank 2 left the old world for the announced one
        assert any(
            x.startswith(f"[{who}] ringtrain elastic: rank {who}: ")
            and x.endswith("; re-forming: joining the world the launcher announced")
            for x in err
        ), proc.stderr
    for who in ("0", "1", "2"):
        assert any(
            x.startswith(f"[{who}] ringtrain elastic: generation 1: the world was re-formed ")
            for x in err
        ), proc.stderr


def test_a_re_form_request_is_granted_after_its_grace_unless_the_world_changed() -> None:
    """The launcher's side: a request re-forms the same members once it stood
    ``REFORM_GRACE_S``; a rank's exit seen meanwhile re-forms without it, and the request,
    which was for the older world, lapses; below --min-np, or once a rank finished, no request
    re-forms a world."""

    class Store:
        def __init__(self) -> None:
            self.keys: dict[str, str] = {}

        def present(self, keys: list[str], timeout_s: float = 5.0) -> set[str]:
            return {k for k in keys if k in self.keys}

        def publish(self, key: str, value: str) -> None:
            self.keys[key] = value

    grace = elastic.REFORM_GRACE_S
    store, m, requests = Store(), elastic.Membership([0, 1, 2], min_np=2), elastic.ReformRequests()

    def poll(now: float, finished: bool = False) -> list[int]:
        return requests.poll(m, store, now, finished)

    assert poll(0.0) == []
    store.keys[elastic.reform_key(0, 2)] = "1"
    assert poll(10.0) == [] and m.generation == 0  # within its grace
    store.keys[elastic.reform_key(0, 0)] = "1"
    assert poll(10.0 + grace, finished=True) == []
    assert poll(10.0 + grace) == [0, 2]
    assert m.generation == 1 and m.members == [0, 1, 2]
    assert store.keys[elastic.GENERATION_KEY] == "1"
    assert store.keys[elastic.members_key(1)] == "[0,1,2]"
    assert poll(20.0 + grace) == []  # those were for world 0
    store.keys[elastic.reform_key(1, 1)] = "1"
    assert poll(30.0) == []
    assert m.lose(2) and m.generation == 2  # rank 2 exits within the grace: a world without it
    assert poll(30.0 + grace) == [] and m.generation == 2
    store.keys[elastic.reform_key(2, 0)] = "1"
    assert not m.lose(1)  # below --min-np the world stays as it is, waiting for hosts
    assert poll(40.0) == [] and poll(40.0 + grace) == []
    assert m.generation == 2


@pytest.mark.timeout(300)
def test_without_elastic_flags_a_killed_rank_ends_the_job() -> None:
    proc = _job(victim=1)
    assert proc.returncode == 137, proc.stdout + proc.stderr
    assert "re-forming" not in proc.stderr and "[0] done" not in proc.stdout


def test_membership_drops_failed_ranks_until_min_np() -> None:
    m = elastic.Membership([0, 1, 2, 3], min_np=2)
    assert m.lose(2) and m.members == [0, 1, 3] and m.generation == 1
    assert m.announcement() == [
        ("ringtrain/elastic/members/1", "[0,1,3]"),
        ("ringtrain/elastic/generation", "1"),
    ]
    assert m.lose(0) and m.members == [1, 3]
    assert not m.lose(1) and m.gone == [2, 0, 1]


@pytest.mark.parametrize(
    "kw",
    [{"min_np": 4}, {"min_np": 0}, {"max_np": 2}, {"min_np": 2, "elastic_timeout_s": 0}],
)
def test_elastic_flags_are_checked(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        LaunchOptions(np=3, hosts=(Host("localhost", 3),), command=("x",), **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_a_sharded_optimizers_state_is_restored_after_a_peer_failure() -> None:
    """The survivor restored its last commit into the old world's shards, which the re-formed
    world then dropped: Adam's moments and step count were lost (an empty state at the reset,
    and Adam started over) with no word. The restore now comes after the re-forming."""
    job = Path(__file__).parent / "sharded_state_job.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--min-np", "1"]
    proc = run_job([*cmd, sys.executable, str(job)], env, timeout=240, rank_marker=str(job))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commits = {c["batch"]: c["opt"] for c in _fields(proc.stdout, "commit") if c["id"] == "0"}
    (reset,) = _fields(proc.stdout, "reset")
    assert reset["batch"] == "4", proc.stdout
    assert reset["opt"] == commits["4"], proc.stdout  # the committed state, not an empty one
    assert [d["id"] for d in _fields(proc.stdout, "done")] == ["0"]


_RAISES_AFTER_REFORM = """
import os, torch, ringtrain.torch as hvd
hvd.init()
state = hvd.elastic.ObjectState(step=0)

@hvd.elastic.run
def train(state):
    while state.step < 4:
        hvd.allreduce(torch.ones(1), name="x")
        state.step += 1
        state.commit()
        if state.step == 2 and hvd.size() == 2 and hvd.rank() == 0:
            os._exit(1)

train(state)
raise ValueError(f"boom as rank {hvd.rank()} of {hvd.size()}")
"""


@pytest.mark.timeout(300)
def test_a_traceback_after_a_reform_has_one_rank_prefix_naming_the_new_rank(
    tmp_path: Path,
) -> None:
    """torch's init_process_group wraps sys.excepthook anew at each call: after a re-form the
    traceback read "[rank0]: [rank1]: Traceback", the inner prefix naming the old rank. Now
    one prefix, the rank the process has in the world it failed in."""
    job = tmp_path / "raises_after_reform.py"
    job.write_text(_RAISES_AFTER_REFORM)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--min-np", "1"]
    proc = run_job([*cmd, sys.executable, str(job)], env, timeout=240, rank_marker=str(job))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("[1] [rank")]
    assert said, proc.stdout + proc.stderr
    assert said[-1] == "[1] [rank0]: ValueError: boom as rank 0 of 1", said
    assert all(line.startswith("[1] [rank0]: ") and line.count("[rank") == 1 for line in said)
