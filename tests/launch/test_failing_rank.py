"""A rank that fails after ``init()`` ends the job within seconds, named first (issue 37).

The most common failure of all: a training script raises, calls ``sys.exit(3)`` or hits a
CheckpointError on one rank while its peer waits for it (in a negotiated allreduce, the fast
lane, ``step()``, the first ``step()`` or a checkpoint save). The failing rank must leave with its own exit code
(its shutdown does not wait for peers that will not come), the peer's wait must end with an
error naming the failed rank, and the launcher must name the failing rank first. Also under
torchrun, where ringtrain's launcher is absent.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from _mpirun import mpirun_env

HERE = Path(__file__).parent
JOB = HERE / "failing_job.py"
# From the failure to the launcher's exit: the 10 s, doubled for a loaded machine (the
# failing rank's interpreter takes seconds to finalize under load; quiet, the whole end takes
# one to two seconds). The hang this guards against lasted minutes. Ranks reach the failure
# after importing torch and init(), which is why the whole job gets more time than this.
ENDS_WITHIN_S = 20.0

pytestmark = pytest.mark.timeout(240)


def _run(
    argv: list[str], out: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the job did not end:\n{stdout}\n{stderr}") from None
    ended = time.time()
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    failed_at = float((out / "failed_at").read_text())
    return done, ended - failed_at


@pytest.mark.parametrize(
    ("how", "where", "code"),
    [
        ("raise", "allreduce", 1),
        ("finally", "allreduce", 1),
        ("exit3", "step", 3),
        ("exit3", "allreduce", 3),
        ("osexit", "step", 5),
        ("raise", "first-step", 1),
        ("checkpoint", "save", 1),
        ("raise", "lane", 1),
    ],
)
def test_the_job_ends_naming_the_failed_rank(
    tmp_path: Path, how: str, where: str, code: int
) -> None:
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--"]
    argv += [sys.executable, str(JOB), str(tmp_path), how, where]
    done, took = _run(argv, tmp_path)
    report = done.stderr[done.stderr.index("ringtrain run: job failed") :]
    assert done.returncode == code, done.stdout + done.stderr
    print(f"{how}/{where}: the job ended {took:.1f} s after rank 1 failed")
    assert took < ENDS_WITHIN_S, f"the job ended {took:.1f} s after rank 1 failed"
    # The root cause first: rank 1, its exit code and its own last words.
    assert report.startswith("ringtrain run: job failed"), report
    first = report.splitlines()[0]
    assert "rank 1 " in first and f"exited with code {code}" in first, report
    at = 1 if where == "first-step" else 6
    if how in ("raise", "finally"):
        assert f"ValueError: boom at step {at}" in report
    if how == "checkpoint":
        assert "CheckpointError" in report
    # Where rank 0 lived to say so, it named rank 1 too.
    if where == "lane":  # the peer waited in the fast lane, not a negotiated round
        valid, _ = ast.literal_eval((tmp_path / "lane.0").read_text())
        assert valid > 0
    said = tmp_path / "error.0"
    if how == "exit3":  # its code, which only the launcher saw, reached the peer (issue 37)
        _, error = json.loads(said.read_text())
        assert "rank 1 (host" in error and "failed: exited with code 3" in error, error
    elif how == "osexit":  # no post at all: the launcher's record names it, not Gloo's words
        _, error = json.loads(said.read_text())
        assert error.startswith("PeerFailedError"), error
        assert "rank 1 failed: exited with code 5" in error, error
    elif where == "first-step" and said.exists():  # not Gloo's "Connection reset by peer"
        # (A loaded machine can hold rank 0 past the launcher's grace before its wait breaks.)
        _, error = json.loads(said.read_text())
        assert error.startswith("PeerFailedError") and "ValueError: boom at step 1" in error, error
    elif how == "finally":  # its shutdown() ran before the except hook: it still said why
        _, error = json.loads(said.read_text())
        assert "rank 1 failed (ValueError: boom at step 6)" in error, error
    elif said.exists():
        _, error = json.loads(said.read_text())
        assert "rank 1" in error, error


@pytest.mark.parametrize("where", ["step", "allreduce"])
def test_a_peer_killed_without_last_words_is_a_horovod_internal_error(
    tmp_path: Path, where: str
) -> None:
    """SIGKILL (the OOM killer, a lost host) leaves no departure to read: the survivor's
    ``step()`` raised Gloo's bare RuntimeError, which ``except hvd.HorovodInternalError`` (the
    error Horovod's ``synchronize`` raises for any failed collective) did not catch. Its error
    names the rank from the launcher's record of its end."""
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--"]
    argv += [sys.executable, str(JOB), str(tmp_path), "kill", where]
    done, took = _run(argv, tmp_path)
    assert "rank 1 " in done.stderr and "SIGKILL" in done.stderr, done.stderr
    assert took < ENDS_WITHIN_S, f"the job ended {took:.1f} s after rank 1 was killed"
    _, error = json.loads((tmp_path / "error.0").read_text())
    assert (tmp_path / "horovod.0").read_text() == "True", error
    assert "peer" in error, error
    # The launcher's record of its end, which the peer waits for where no post is to be read.
    assert "rank 1 failed: was killed by SIGKILL" in error, error


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="no torchrun",
)
@pytest.mark.parametrize("where", ["step", "allreduce"])
def test_under_torchrun_a_rank_that_called_sys_exit_is_not_said_to_have_finished(
    tmp_path: Path, where: str
) -> None:
    """``sys.exit(3)`` while the peer waits in ``step()`` or a negotiated allreduce: torchrun
    records no exit code where a peer can read it, so the peer cannot know it; its error said
    "finished" and "HINT: no rank failed" (or "shut down (its script ended or called
    shutdown())"), and now says what it cannot know and where the code is."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    argv = [torchrun, "--nproc-per-node", "2", "--monitor-interval", "0.5"]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    argv += [str(JOB), str(tmp_path), "exit3", where]
    done, _ = _run(argv, tmp_path)
    assert done.returncode != 0
    _, error = json.loads((tmp_path / "error.0").read_text())
    assert error.startswith("PeerFailedError") and "rank 1 (host" in error, error
    assert "its script ended or called sys.exit()" in error, error
    assert "HINT: no rank failed;" not in error, error


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="no torchrun",
)
def test_under_torchrun_a_rank_killed_without_last_words_is_named(tmp_path: Path) -> None:
    """SIGKILL (as the OOM killer sends it) while the peer waits in a negotiated allreduce:
    no post, and torchrun records no exit where a peer can read it, so the peer's error said
    only what the transport said. Its process ran on the peer's machine, which sees it ended:
    the error names rank 1 and says where its exit code is."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    argv = [torchrun, "--nproc-per-node", "2", "--monitor-interval", "0.5"]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    argv += [str(JOB), str(tmp_path), "kill", "allreduce"]
    done, took = _run(argv, tmp_path)
    assert done.returncode != 0
    _, error = json.loads((tmp_path / "error.0").read_text())
    assert error.startswith("PeerFailedError"), error
    said = f"rank 1 (host {socket.gethostname()}) ended without a word (os._exit, or killed by a"
    assert said in error, error
    assert "HINT: the exit code your launcher reports for rank 1 tells" in error, error
    assert (tmp_path / "horovod.0").read_text() == "True", error
    assert took < ENDS_WITHIN_S, f"the job ended {took:.1f} s after rank 1 was killed"


@pytest.mark.skipif(
    shutil.which("torchrun") is None and not Path(sys.executable).with_name("torchrun").exists(),
    reason="no torchrun",
)
def test_under_torchrun_the_peer_ends_naming_the_failed_rank_and_a_restarted_try_starts_afresh(
    tmp_path: Path,
) -> None:
    """torchrun --max-restarts: rank 1 raises in the first try while rank 0 waits for it in a
    negotiated allreduce, whose wait ends naming rank 1 and its exception (the peer's own end:
    torchrun's teardown after it is torchrun's); torchrun then starts both ranks again. Its
    agent keeps its store, so the new try's init() read the first try's keys (the dead ranks'
    addresses) and hung; each try now has keys of its own, as in torch's env://. One job for
    both: each torchrun job costs about 10 s of CPU."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    argv = [torchrun, "--nproc-per-node", "2", "--monitor-interval", "0.5", "--max-restarts", "1"]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    argv += [str(HERE / "restart_job.py"), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "boom in the first try" in done.stderr  # the first try did fail
    at, error = json.loads((tmp_path / "error.0").read_text())
    took = at - float((tmp_path / "failed_at").read_text())
    print(f"torchrun: the peer's wait ended {took:.1f} s after rank 1 failed")
    assert took < ENDS_WITHIN_S, f"the peer's wait ended {took:.1f} s after rank 1 failed"
    assert "PeerFailedError" in error and "rank 1 failed (ValueError: boom in the first try)" in (
        error
    ), error
    results = [json.loads((tmp_path / f"result.{r}").read_text()) for r in range(2)]
    assert [r[:2] for r in results] == [[1, 3.0], [1, 3.0]]
    assert results[0][2] == results[1][2]  # the same weights on both ranks


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (openmpi-bin)")
def test_under_mpirun_the_job_ends_and_the_peer_names_the_failed_rank(tmp_path: Path) -> None:
    """Plain ``mpirun -np 2`` (rank 0 serves the store; nothing exported but what lets mpirun
    run as root here): rank 1 raises after init(), its peer's allreduce ends naming it, and
    mpirun ends the job with a failing code."""
    argv = ["mpirun", "-np", "2", sys.executable, str(JOB), str(tmp_path), "raise", "allreduce"]
    done, took = _run(argv, tmp_path, mpirun_env())
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    print(f"mpirun: the job ended {took:.1f} s after rank 1 failed")
    assert took < ENDS_WITHIN_S, f"the job ended {took:.1f} s after rank 1 failed"
    at, error = json.loads((tmp_path / "error.0").read_text())
    assert "PeerFailedError" in error and "rank 1 failed (ValueError: boom at step 6)" in error
    assert at - float((tmp_path / "failed_at").read_text()) < ENDS_WITHIN_S
