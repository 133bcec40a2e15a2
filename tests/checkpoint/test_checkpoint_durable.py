"""``ringtrain run --checkpoint-dir D --checkpoint-every N``, then ``kill -9`` of the launcher,
then ``ringtrain run --resume D``: the job finishes with the weights of an uninterrupted run.
A new job (no ``--resume``) pointed at D, which holds that run's checkpoints, refuses to start
and changes nothing in D."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch

from _durable_runs import until_started, wait_for_commit
from _mpirun import mpirun_env
from ringtrain.checkpoint import manifest
from ringtrain.errors import ConfigError
from ringtrain.launch import command

pytestmark = pytest.mark.timeout(600)
JOB = str(Path(__file__).with_name("durable_job.py"))
STEPS = 12


def _argv(*flags: str, out: Path, pause: float) -> list[str]:
    return [
        sys.executable, "-m", "ringtrain", "run", "-np", "2", *flags,
        "--", sys.executable, JOB, str(out), str(STEPS), str(pause),
    ]  # fmt: skip


def _run(*flags: str, out: Path) -> str:
    proc = subprocess.run(
        _argv(*flags, out=out, pause=0.0), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One uninterrupted run (its checkpoint directory and final weights), shared by the tests:
    the reference weights of a resumed run, and a used directory for a new job. Its ranks save
    with the thread writer, which spares each a writer process (a torch import); the killed job
    and the resumed one keep the default, writer processes."""
    root = tmp_path_factory.mktemp("finished")
    ck, out = root / "ck", root / "a.pt"
    said = _run(
        *("--checkpoint-dir", str(ck), "--checkpoint-every", "2"),
        *("--checkpoint-writer", "thread", "--log-level", "INFO"),
        out=out,
    )
    assert said.count("the thread writer (asked for)") == 2, said  # the flag reached each rank
    assert [s for s, _ in manifest.committed(str(ck))] == [8, 10, 12]  # keep 3
    return ck, out


def test_kill_9_the_launcher_then_resume(tmp_path: Path, finished_run: tuple[Path, Path]) -> None:

    ck = tmp_path / "b"
    launcher = subprocess.Popen(
        _argv("--checkpoint-dir", str(ck), "--checkpoint-every", "2", out=tmp_path / "b.pt",
              pause=0.5),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_commit(launcher, ck, 4)
        family = psutil.Process(launcher.pid).children(recursive=True)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(10)
        _, alive = psutil.wait_procs(family, timeout=60)
        assert not alive, f"processes outlived the launcher: {alive}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    saved = max(s for s, _ in manifest.committed(str(ck)))
    assert saved < STEPS and not (tmp_path / "b.pt").exists()

    _run("--resume", str(ck), "--checkpoint-every", "2", out=tmp_path / "b.pt")
    want = torch.load(finished_run[1])
    got = torch.load(tmp_path / "b.pt")
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    # The resumed job continues the killed run: keep 3 counts the checkpoints it resumed from.
    assert [s for s, _ in manifest.committed(str(ck))] == [8, 10, 12]


def test_a_preempted_job_commits_the_save_in_flight(tmp_path: Path) -> None:
    """SIGTERM to the launcher (a preemption) while a save is being written: the ranks unwind
    (Durable turns SIGTERM into SystemExit) and their ``with`` block waits for the save, which
    commits within the grace period. Python's default ended the ranks at once, and their writers
    with them. The writers are held (SIGSTOP) so that a save is surely in flight."""
    ck = tmp_path / "ck"
    argv = _argv("--checkpoint-dir", str(ck), "--checkpoint-every", "2", out=tmp_path / "p.pt",
                 pause=0.3)  # fmt: skip
    argv[argv.index(str(STEPS))] = "1000"  # ends only by the signal
    launcher = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_commit(launcher, ck, 2)
        family = psutil.Process(launcher.pid).children(recursive=True)
        writers = [
            p for p in family if "ringtrain.checkpoint.process_writer" in " ".join(p.cmdline())
        ]
        assert len(writers) == 2, family
        for w in writers:
            w.suspend()
        held = max(s for s, _ in manifest.committed(str(ck)))
        _until_handed_over(writers)
        launcher.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # every rank has its SIGTERM
        for w in writers:
            with contextlib.suppress(psutil.NoSuchProcess):
                w.resume()
        _, err = launcher.communicate(timeout=120)
        _, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, f"processes outlived the job: {alive}"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 143, err.decode()[-3000:]
    assert max(s for s, _ in manifest.committed(str(ck))) > held, err.decode()[-3000:]


def _preempted(ck: Path, out: Path, preempt: Callable[[subprocess.Popen[bytes]], None]) -> str:
    """A 2-rank job saving into ``ck`` every 100 steps of 1,000 (no save comes due), given
    SIGTERM by ``preempt`` once both ranks started; its stderr, once it exited with 143."""
    argv = _argv("--checkpoint-dir", str(ck), "--checkpoint-every", "100", out=out, pause=0.3)
    argv[argv.index(str(STEPS))] = "1000"  # ends only by the signal
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        until_started(launcher)
        preempt(launcher)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 143, err.decode()[-3000:]
    return err.decode()


def _stopped_at(err: str, ck: Path) -> int:
    """The step a preemption stopped the job at (rank 0 says it), checked to be the one
    checkpoint in ``ck``: no save was due, so that save is the preemption's, and it committed,
    so every rank wrote its part of it."""
    said = re.search(r"the job stops at step (\d+), saved into", err)
    assert said, err[-3000:]
    step = int(said[1])
    assert [s for s, _ in manifest.committed(str(ck))] == [step], err[-3000:]
    return step


def test_a_preempted_job_saves_the_step_it_stops_at_and_resumes_from_it(
    tmp_path: Path, finished_run: tuple[Path, Path]
) -> None:
    """SIGTERM to the launcher, no save due: the ranks, which take the signal at different
    statements, agree on a step, save it and exit with 143; resumed from it, the job ends with
    the weights of the uninterrupted run, bit for bit."""

    ck = tmp_path / "ck"
    err = _preempted(ck, tmp_path / "p.pt", lambda launcher: launcher.send_signal(signal.SIGTERM))
    assert "2 rank(s) got SIGTERM" in err
    assert "job terminated (SIGTERM): every rank stopped within the grace period of 20 s after " \
        "SIGTERM at the step the job saved" in err, err[-3000:]  # fmt: skip
    assert _stopped_at(err, ck) < STEPS  # the resumed job has steps left to take
    _run("--resume", str(ck), out=tmp_path / "b.pt")
    for a, b in zip(torch.load(finished_run[1]), torch.load(tmp_path / "b.pt")):
        assert torch.equal(a, b)


def test_a_rank_preempted_alone_stops_its_peer_at_the_same_saved_step(tmp_path: Path) -> None:
    """SIGTERM to rank 1 alone (as when one worker's pod is deleted): rank 0, never signalled,
    saves the same step and stops with it. Before, rank 1 left at once and rank 0 failed in its
    next collective, with no checkpoint at all. The launcher, which got no signal itself, says
    the job stopped on a preemption (each rank told its agent so), not that it failed."""

    def to_rank_1(launcher: subprocess.Popen[bytes]) -> None:
        family = psutil.Process(launcher.pid).children(recursive=True)
        ranks = [p for p in family if JOB in p.cmdline()]
        (one,) = [p for p in ranks if p.environ().get("RINGTRAIN_RANK") == "1"]
        one.send_signal(signal.SIGTERM)

    ck = tmp_path / "ck"
    err = _preempted(ck, tmp_path / "p.pt", to_rank_1)
    assert "1 rank(s) got SIGTERM" in err
    _stopped_at(err, ck)
    assert "PeerFailedError" not in err
    assert "ringtrain run: job stopped on a preemption: ranks 0, 1 exited with code 143" in err
    assert "job failed" not in err and "stopping the other" not in err, err[-3000:]


TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _torchrun(node: int, port: int, out: Path, steps: int, **env: str) -> subprocess.Popen[str]:
    """Node ``node`` of a 2-node torchrun job of durable_job.py (one rank each, static
    rendezvous at ``port``, as a PyTorchJob's pods start), ``env`` added."""
    argv = [
        TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
        "--monitor-interval", "0.5", JOB, str(out), str(steps), "0.3" if steps > STEPS else "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_pod_deleted_under_torchrun_stops_at_a_saved_step_and_resumes(
    tmp_path: Path, finished_run: tuple[Path, Path]
) -> None:
    """The manifests ``ringtrain k8s`` writes start ranks with torchrun. A deleted pod's
    torchrun gets SIGTERM and passes it to its rank: both ranks save the step they agree on
    and exit with 143 (torchrun reports that as its worker's failure: its exit is its own);
    rank 0 says how to continue without ``ringtrain run`` (``RINGTRAIN_RESUME``), and resumed
    so, both ranks start at that step and end with the uninterrupted run's weights."""
    ck = tmp_path / "ck"
    saving = {"RINGTRAIN_CHECKPOINT_DIR": str(ck), "RINGTRAIN_CHECKPOINT_EVERY": "100"}
    port = _free_port()
    nodes = [_torchrun(n, port, tmp_path / "p.pt", 1000, **saving) for n in (0, 1)]
    try:
        for node in nodes:
            assert node.stdout is not None
            while " starts at step 0" not in node.stdout.readline():
                assert node.poll() is None, "a node ended before its rank started"
        nodes[1].send_signal(signal.SIGTERM)  # what the kubelet sends a deleted pod
        err = nodes[0].communicate(timeout=120)[1]
        nodes[1].communicate(timeout=120)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    said = re.search(r"rank 0: 1 rank\(s\) got SIGTERM \(a preemption\): the job stops at step "
                     r"(\d+), saved into \S+ \(continue with RINGTRAIN_RESUME=(\S+) in the next "
                     r"start's environment\)", err)  # fmt: skip
    assert said and said[2] == str(ck), err[-3000:]
    step = int(said[1])
    assert [s for s, _ in manifest.committed(str(ck))] == [step] and step < STEPS, err[-3000:]
    assert "exitcode  : 143" in err, err[-3000:]  # torchrun's own report of its worker's end
    port = _free_port()
    again = [_torchrun(n, port, tmp_path / "b.pt", STEPS, RINGTRAIN_RESUME=str(ck)) for n in (0, 1)]
    ends = [node.communicate(timeout=180) for node in again]
    assert [node.returncode for node in again] == [0, 0], ends[0][1][-3000:] + ends[1][1][-3000:]
    assert all(f" starts at step {step}" in out for out, _ in ends), ends
    for a, b in zip(torch.load(finished_run[1]), torch.load(tmp_path / "b.pt")):
        assert torch.equal(a, b)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (openmpi-bin)")
@pytest.mark.parametrize("sigkill_timeout_s", [None, 10])
def test_a_preempted_mpirun_job_saves_given_the_time(
    tmp_path: Path, sigkill_timeout_s: int | None
) -> None:
    """mpirun, given SIGTERM, passes it to the ranks ``odls_base_sigkill_timeout`` seconds later
    (1 by default) and SIGKILLs them as long after that. With the default, rank 0 warns when
    the job starts, and no line claims a save that did not commit. Given 10 s (and a grace
    period of 10 s), the ranks stop at a step, save it, and rank 0 names it. Beside stress-ng
    too: the stop's save is written on the ranks' own threads (no writer process has started:
    at nice +19 on two busy cores, one took more than 8 s to start and write)."""
    ck = tmp_path / "ck"
    env = {**mpirun_env(), "OMP_NUM_THREADS": "1", "RINGTRAIN_CHECKPOINT_DIR": str(ck),
           "RINGTRAIN_CHECKPOINT_EVERY": "1000"}  # fmt: skip
    mca = []
    if sigkill_timeout_s is not None:
        mca = ["--mca", "odls_base_sigkill_timeout", str(sigkill_timeout_s)]
        env["RINGTRAIN_GRACE_PERIOD_S"] = str(sigkill_timeout_s)
    argv = ["mpirun", "-np", "2", *mca, sys.executable, JOB, str(tmp_path / "p.pt"), "1000", "0.3"]
    mpirun = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        until_started(mpirun)
        mpirun.send_signal(signal.SIGTERM)
        err = mpirun.communicate(timeout=120)[1].decode()
    finally:
        if mpirun.poll() is None:
            mpirun.kill()
            mpirun.wait()
    warned = "under mpirun, a SIGTERM (a preemption) reaches the ranks with 1 s left" in err
    said = re.search(r"the job stops at step (\d+), saved into", err)
    # No line claims a save that did not commit (within 1 s, one may: a step of 0.3 s, a
    # small save on a thread).
    committed = [s for s, _ in manifest.committed(str(ck))]
    assert len(committed) <= 1 and (not said or committed == [int(said[1])]), err[-3000:]
    if sigkill_timeout_s is None:
        assert warned and "HINT: mpirun --mca odls_base_sigkill_timeout 20" in err, err[-3000:]
    else:
        assert not warned and "odls_base_sigkill_timeout" not in err, err[-3000:]
        assert said, err[-3000:]


def _elastic_argv(ck: Path, steps: int, *flags: str, np: int = 3, size: int = 0) -> list[str]:
    """``ringtrain run`` of durable_elastic_job.py, ``np`` ranks (``--min-np 2``), no save due
    on the schedule; with ``size``, the job runs until its world has that many ranks."""
    return [
        sys.executable, "-m", "ringtrain", "run", "-np", str(np), "--min-np", "2", *flags,
        "--checkpoint-every", "1000",
        "--", sys.executable, str(Path(__file__).with_name("durable_elastic_job.py")), str(steps),
        str(size),
    ]  # fmt: skip


@contextlib.contextmanager
def _elastic_job(
    ck: Path, steps: int, np: int = 3, *flags: str, size: int = 0, **env: str
) -> Iterator[tuple[subprocess.Popen[str], dict[int, int]]]:
    """An elastic durable job of ``np`` ranks saving into ``ck``, once its ranks started: the
    launcher and the ranks' pids; killed on the way out if it still runs."""
    argv = _elastic_argv(ck, steps, "--checkpoint-dir", str(ck), *flags, np=np, size=size)
    launcher = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    try:
        assert launcher.stdout is not None
        pids: dict[int, int] = {}
        while len(pids) < np:
            line = launcher.stdout.readline()
            assert line, "the job ended before its ranks started"
            starts = re.search(r"rank (\d) starts at step 0, pid (\d+)", line)
            if starts:
                pids[int(starts[1])] = int(starts[2])
        yield launcher, pids
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_in_an_elastic_job_preempted_ranks_save_with_their_peers_and_they_go_on(
    tmp_path: Path,
) -> None:
    """``--min-np 2``: SIGTERM to ranks 2 and 3 of 4 at once; every rank saves the step they
    stop at (the save commits: every part was written), ranks 2 and 3 leave with 143, the
    others re-form once (not once per exit: each stopping rank told the launcher its step
    first) and finish. Every rank writes that save on its own thread (the job's writer is a
    process, at nice +19: HOROVOD_LOG_LEVEL=info shows the choice)."""
    ck = tmp_path / "ck"
    with _elastic_job(ck, 80, np=4, HOROVOD_LOG_LEVEL="info") as (launcher, pids):
        os.kill(pids[2], signal.SIGTERM)
        os.kill(pids[3], signal.SIGTERM)
        out, said = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, said[-3000:]
    stops = re.findall(r"(?m)^\[([23])\] ringtrain: rank \1: SIGTERM \(a preemption\): this "
                       r"rank stops at step (\d+), saved into \S+ with its peers, which go on",
                       said)  # fmt: skip
    assert sorted(r for r, _ in stops) == ["2", "3"] and stops[0][1] == stops[1][1], said[-3000:]
    assert [s for s, _ in manifest.committed(str(ck))] == [int(stops[0][1])], said[-3000:]
    once = re.search(r"stopped on a preemption at a step it saved \(exit code 143\) after "
                     r"[\d.]+ s; rank\(s\) [23] stop at that step too; re-forming the world "
                     r"with the 2 remaining rank\(s\) \[0, 1\] \(generation 1\)", said)  # fmt: skip
    assert once and "generation 2" not in said, said[-3000:]
    assert "it had left the world with the ranks that stopped at that step" in said, said[-3000:]
    assert "earlier, 2 rank(s) stopped on a preemption and the job went on" in said, said[-3000:]
    threads = re.findall(r"(?m)^\[(\d)\] .*a preemption's save: written on this rank's own thread",
                         said)  # fmt: skip
    assert sorted(threads) == ["0", "1", "2", "3"], said[-3000:]
    assert sorted(re.findall(r"rank (\d) of (\d) ends at step (\d+)", out)) == [
        ("0", "2", "80"),
        ("1", "2", "80"),
    ]


def test_a_preempted_host_the_discovery_script_still_offers_gets_a_rank_again(
    tmp_path: Path,
) -> None:
    """``--host-discovery-script`` offering localhost:2 and 127.0.0.1:1 throughout: SIGTERM to
    the rank on 127.0.0.1 (a preempted pod the platform re-creates under its name). It saves
    with its peers and stops; its host is not excluded, as a failing rank's would be, so a
    new rank starts there, joins the two that went on, and the world of 3 finishes."""
    ck = tmp_path / "ck"
    disc = tmp_path / "discover.sh"
    disc.write_text("#!/bin/sh\nprintf 'localhost:2\\n127.0.0.1:1\\n'\n")
    disc.chmod(0o755)
    flags = ("--max-np", "3", "--host-discovery-script", str(disc))
    with _elastic_job(ck, 60, 3, *flags, size=3) as (launcher, pids):
        os.kill(pids[2], signal.SIGTERM)
        out, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 0, err[-3000:]
    assert re.search(r"rank 2 \(host 127\.0\.0\.1, pid \d+\) stopped on a preemption", err), err
    assert "host 127.0.0.1 is not excluded: its rank stopped on a preemption" in err, err[-3000:]
    assert "excluding host" not in err, err[-3000:]
    assert "growing the world to 3 rank(s) [0, 1, 3]" in err, err[-3000:]
    stop = re.search(r"rank 2: SIGTERM \(a preemption\): this rank stops at step (\d+)", err)
    assert stop and [s for s, _ in manifest.committed(str(ck))] == [int(stop[1])], err[-3000:]
    ends = re.findall(r"rank (\d) of 3 ends at step (\d+)", out)
    assert sorted(r for r, _ in ends) == ["0", "1", "2"] and len({s for _, s in ends}) == 1, out


def test_an_elastic_job_whose_last_world_is_preempted_stopped_on_a_preemption(
    tmp_path: Path,
) -> None:
    """``--min-np``: SIGTERM to rank 2 alone, the others go on in a world of 2; then SIGTERM to
    both: they save the step they stop at and the job ends with 143 as a preempted job (the
    last world counts, as for its exit code), with rank 2's earlier stop listed, not "job
    failed" for want of ranks; resumed, a world of 3 starts at the saved step."""
    ck = tmp_path / "ck"
    with _elastic_job(ck, 1000) as (launcher, pids):
        assert launcher.stdout is not None
        os.kill(pids[2], signal.SIGTERM)
        # The world of 2 goes on from the last commit, below rank 2's stop, and commits again
        # 5 steps on: past that stop.
        while not re.search(r"rank 0 of 2 commits step", launcher.stdout.readline()):
            if launcher.poll() is not None:
                assert launcher.stderr is not None
                pytest.fail(f"ended before the world of 2 committed: {launcher.stderr.read()}")
        os.kill(pids[0], signal.SIGTERM)
        os.kill(pids[1], signal.SIGTERM)
        out, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 143, err[-3000:]
    first = re.search(r"rank 2: SIGTERM \(a preemption\): this rank stops at step (\d+)", err)
    last = re.search(r"rank 0: 2 rank\(s\) got SIGTERM \(a preemption\): the job stops at step "
                     r"(\d+), saved into", err)  # fmt: skip
    assert first and last, err[-3000:]
    assert [s for s, _ in manifest.committed(str(ck))] == [int(first[1]), int(last[1])]
    # The peers that went on named rank 2's stop (its departure), not a failure of its script.
    assert re.search(r"\[0\] ringtrain elastic: generation 1: rank\(s\) \[2\] left \(a peer "
                     r"stopped on a preemption: .*rank 2 \(host localhost\) stopped on a "
                     r"preemption at step \d+, saved with this rank", err), err  # fmt: skip
    assert "exit code this rank cannot see" not in err, err
    # Ranks 0 and 1 do not say they leave peers that go on: none does.
    assert not re.search(r"rank [01]: SIGTERM \(a preemption\): this rank stops", err), err
    end = err[err.index("ringtrain run: job stopped on a preemption: ranks 0, 1 exited") :]
    assert "continue, run the job again with --resume" in end, err[-3000:]
    assert "earlier, 1 rank(s) stopped on a preemption and the job went on" in end, end
    assert "rank 2 (host localhost, pid" in end, end
    assert "job failed" not in err, err[-3000:]
    assert "ends at step" not in out
    # What the report says to do: --resume starts every rank of a new world of 3 at the step
    # the world of 2 saved, and the job finishes from there.
    stop = int(last[1])
    again = subprocess.run(_elastic_argv(ck, stop + 5, "--resume", str(ck)),
                           capture_output=True, text=True, timeout=240)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    starts = re.findall(r"rank (\d) starts at step (\d+)", again.stdout)
    assert sorted(starts) == [(str(r), str(stop)) for r in range(3)], again.stdout
    ends = re.findall(r"rank (\d) of 3 ends at step (\d+)", again.stdout)
    assert sorted(ends) == [(str(r), str(stop + 5)) for r in range(3)], again.stdout


def test_an_elastic_job_preempted_below_min_np_stops_at_one_step(tmp_path: Path) -> None:
    """``--min-np 2``: SIGTERM to ranks 1 and 2 of 3 at once. They stop at the same saved
    step and say that one rank remains, fewer than --min-np (not that their peers go on);
    the launcher hears of them one by one, yet reports one stop at that step, not a rank the
    job went on without."""
    ck = tmp_path / "ck"
    with _elastic_job(ck, 1000) as (launcher, pids):
        assert launcher.stdout is not None
        while not re.search(r"rank 0 of 3 commits step", launcher.stdout.readline()):
            assert launcher.poll() is None, "the job ended before its first commit"
        os.kill(pids[1], signal.SIGTERM)
        os.kill(pids[2], signal.SIGTERM)
        _, err = launcher.communicate(timeout=240)
    assert launcher.returncode == 143, err[-3000:]
    said = re.findall(r"(?m)^\[[12]\] ringtrain: rank ([12]): SIGTERM \(a preemption\): this "
                      r"rank stops at step (\d+), saved into \S+ with its peers; 1 rank\(s\) "
                      r"remain, fewer than --min-np 2: the job goes on only if hosts join",
                      err)  # fmt: skip
    assert sorted(r for r, _ in said) == ["1", "2"] and said[0][1] == said[1][1], err[-3000:]
    assert "which go on without it" not in err, err[-3000:]
    step = said[0][1]
    assert [s for s, _ in manifest.committed(str(ck))] == [int(step)], err[-3000:]
    end = err[err.index("ringtrain run: job stopped on a preemption") :]
    assert end.startswith(
        f"ringtrain run: job stopped on a preemption: ranks 1, 2 exited with code 143 at step "
        f"{step}, the step the job saved"
    ), end
    assert "earlier" not in end and "job failed" not in err, err[-3000:]


def _queued(writer: psutil.Process) -> int:
    """Bytes a rank has handed to its writer that the writer has not read: its job pipe's read
    end is the first number after ``-c <program>`` on its command line (process_writer.py)."""
    fd = os.open(f"/proc/{writer.pid}/fd/{writer.cmdline()[3]}", os.O_RDONLY | os.O_NONBLOCK)
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
    finally:
        os.close(fd)


def _until_handed_over(writers: list[psutil.Process], most_s: float = 15.0) -> None:
    """Until each held writer has a save queued (a rank handed it one and went on, to wait for
    it at the next save). A writer held while it wrote a save, or (rank 0's) after it committed
    one but before it said so, never gets one: its rank waits in ``save()`` for that save first,
    and hands the next one over before it unwinds, as its peers did. Past ``most_s`` that is the
    case."""
    deadline = time.monotonic() + most_s
    while time.monotonic() < deadline and not all(_queued(w) for w in writers):
        time.sleep(0.1)


def test_a_new_job_in_a_used_directory_loses_nothing(
    tmp_path: Path, finished_run: tuple[Path, Path]
) -> None:
    ck = finished_run[0]
    before = _files(ck)

    new_job = _argv("--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                    out=tmp_path / "b.pt", pause=0.0)  # fmt: skip
    proc = subprocess.run(new_job, capture_output=True, text=True, timeout=300)
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0, said
    refusal = (
        f"ConfigError: {ck} holds 3 checkpoint(s) of another run (step 8, 10, 12), and this "
        "new job (no --resume) would delete or overwrite them."
    )
    assert refusal in said, said
    assert f"HINT: continue that run with --resume {ck}" in said and "fresh directory" in said
    assert "starts at step" not in said  # refused before the first step
    assert _files(ck) == before and not (tmp_path / "b.pt").exists()
    # What the error suggests (--resume continues that run; a fresh directory starts anew) is
    # tested without a launcher in test_checkpoint_runs.py, and --resume through one above.


def test_bad_schedule_is_refused_by_the_launcher() -> None:
    parser = argparse.ArgumentParser()
    command.configure(parser)
    args = parser.parse_args(["--checkpoint-every", "often", "-np", "1", "--", "true"])
    with pytest.raises(ConfigError, match="expected a positive number of steps or of seconds"):
        command.options_from_args(args)
    good = parser.parse_args(["--checkpoint-every", "300s", "--resume", "D", "-np", "1", "true"])
    settings = command.options_from_args(good).settings
    assert settings["checkpoint_every"] == "300s" and settings["resume"] == "D"
