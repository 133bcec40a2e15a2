"""Real ``srun`` (Debian's slurm-wlm) starts ringtrain jobs with nothing exported by hand.

A throwaway Slurm (:mod:`ringtrain.testing.slurm`: munged, slurmctld and slurmd with a generated
slurm.conf in a temporary directory) on this machine, and one with a slurmd in each of two
namespace hosts. ``SLURM_CONF`` points srun at it; that is the only variable set, and it is for
srun, not ringtrain. Ranks find rank 0 from the job's node list and a port from the job id.
A durable job cancelled with ``scancel`` (a preemption's SIGTERM) stops at a step it saved.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _durable_runs import until_started
from _only_sshd import wait_for_only_sshd
from ringtrain.checkpoint import manifest
from ringtrain.testing import cluster as tc
from ringtrain.testing import slurm

pytestmark = [
    pytest.mark.skipif(
        bool(slurm.missing_tools()),
        reason=f"needs {', '.join(slurm.missing_tools())} (Debian: slurmctld slurmd slurm-client munge)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="the test Slurm runs its daemons as root"),
    pytest.mark.timeout(300),  # above the jobs' own limit, so a hang is reported
]
CLUSTER = 2
JOB = Path(__file__).with_name("launcher_job.py")
LIMIT = 200.0


def _env() -> dict[str, str]:
    """This process's environment without anything that could hand ranks a rendezvous."""
    drop = ("MASTER_", "RINGTRAIN_", "GLOO_", "OMPI_", "PMIX_", "SLURM_", "RANK", "WORLD_SIZE")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _results(out: str) -> list[dict[str, Any]]:
    found = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines() if "RESULT " in ln]
    return sorted(found, key=lambda r: r["rank"])


def _finish(proc: subprocess.Popen[str], logs: Any) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # srun cancels its step on SIGINT
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(f"srun did not finish in {LIMIT}s:\n{out[-3000:]}\n{logs()}") from None
    return proc.returncode, out


# The tests on this machine's test Slurm run on one xdist worker: two test Slurms at once would
# each number their jobs from 1, and the ranks take their port from the job id.
ON_LOCAL_SLURM = pytest.mark.xdist_group("local-slurm")


@pytest.fixture(scope="module")
def local_slurm() -> Iterator[slurm.MiniSlurm]:
    with slurm.MiniSlurm() as s:
        yield s


@ON_LOCAL_SLURM
def test_srun_on_one_node(local_slurm: slurm.MiniSlurm, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        ["srun", "-n", "2", sys.executable, str(JOB)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env={**_env(), **local_slurm.env()},
        start_new_session=True,
    )
    rc, out = _finish(proc, local_slurm.logs)
    assert rc == 0, out[-4000:] + local_slurm.logs()
    res = _results(out)
    assert [r["rank"] for r in res] == [0, 1], out[-4000:]
    for r in res:
        assert r["launcher"] == "slurm"
        assert (r["size"], r["local_rank"], r["local_size"]) == (2, r["rank"], 2)
        assert (r["cross_rank"], r["cross_size"]) == (0, 1)
        assert r["identical"] and r["trained"]


@pytest.mark.cluster
def test_srun_across_two_namespace_hosts(cluster: tc.Cluster, tmp_path: Path) -> None:
    with slurm.MiniSlurm(cluster) as s:
        # srun runs on h0, as from a login node that is also a compute node.
        proc = cluster.popen(
            "h0",
            s.srun_argv("-N", "2", "-n", "4", "--ntasks-per-node", "2", sys.executable, str(JOB)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
            env=_env(),
            start_new_session=True,
        )
        rc, out = _finish(proc, s.logs)
        assert rc == 0, out[-4000:] + s.logs()
    res = _results(out)
    assert [r["rank"] for r in res] == [0, 1, 2, 3], out[-4000:]
    for r in res:
        host = r["rank"] // 2
        assert r["launcher"] == "slurm"
        assert r["host"] == f"h{host}"
        assert (r["size"], r["local_rank"], r["local_size"]) == (4, r["rank"] % 2, 2)
        assert (r["cross_rank"], r["cross_size"]) == (host, 2)
        assert r["identical"] and r["trained"]
    assert len({r["checksum"] for r in res}) == 1
    wait_for_only_sshd(cluster, within=20)  # a step's slurmstepd may take a moment


DURABLE_JOB = [
    str(Path(__file__).parents[1] / "checkpoint" / "durable_job.py"),
    "w.pt",
    "1000",
    "0.3",
]


def _cancelled(
    local_slurm: slurm.MiniSlurm, tmp_path: Path, srun_args: list[str], command: list[str]
) -> tuple[int, str, Path]:
    """``srun SRUN_ARGS COMMAND`` (a durable job of 2 ranks, DURABLE_JOB), ``scancel``ed once
    both ranks started: srun's exit code, its output, and the job's checkpoint directory."""
    ck = tmp_path / "ck"
    saving = {"RINGTRAIN_CHECKPOINT_DIR": str(ck), "RINGTRAIN_CHECKPOINT_EVERY": "1000"}
    name = f"preempted-{os.getpid()}"
    proc = subprocess.Popen(
        ["srun", *srun_args, "-J", name, *command],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        env={**_env(), **local_slurm.env(), **saving}, start_new_session=True,
    )  # fmt: skip
    cancel = ["scancel", "-n", name]
    # srun cancels its step on SIGINT: a job whose ranks never start ends the wait for them.
    stuck = threading.Timer(LIMIT, proc.send_signal, (signal.SIGINT,))
    stuck.start()
    try:
        until_started(proc)
        stuck.cancel()
        subprocess.run(cancel, env={**_env(), **local_slurm.env()}, check=True, timeout=60)
        rc, out = _finish(proc, local_slurm.logs)
    finally:
        stuck.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            subprocess.run(cancel, env={**_env(), **local_slurm.env()}, timeout=60)
    return rc, out, ck


def _saved_where_said(out: str, ck: Path, resume: str) -> None:
    """Rank 0 names the step the job stopped at, and that step alone is in the checkpoint."""
    said = re.search(r"rank 0: 2 rank\(s\) got SIGTERM \(a preemption\): the job stops at step "
                     r"(\d+), saved into \S+ \(continue with " + re.escape(resume), out)  # fmt: skip
    assert said, out[-3000:]
    assert [s for s, _ in manifest.committed(str(ck))] == [int(said[1])], out[-3000:]


@ON_LOCAL_SLURM
def test_a_cancelled_srun_job_stops_at_a_step_it_saved(
    local_slurm: slurm.MiniSlurm, tmp_path: Path
) -> None:
    """``scancel`` (as a preemption with PreemptMode=CANCEL): Slurm sends every task of the job
    SIGTERM, and KillWait later SIGKILL. A durable job started by srun alone (its settings in
    ``RINGTRAIN_*``, as a batch script sets them) stops at one step, saved, with rank 0 saying
    how to continue (``RINGTRAIN_RESUME``), well before the SIGKILL."""
    rc, out, ck = _cancelled(local_slurm, tmp_path, ["-n", "2"], [sys.executable, *DURABLE_JOB])
    _saved_where_said(out, ck, "RINGTRAIN_RESUME=")
    assert rc == 143, out[-3000:]  # srun: its tasks' exit code


@ON_LOCAL_SLURM
@pytest.mark.parametrize("launcher", ["ringtrain-run", "torchrun"])
def test_a_cancelled_launcher_in_the_job_and_its_ranks_all_get_sigterm_and_save_one_step(
    local_slurm: slurm.MiniSlurm, tmp_path: Path, launcher: str
) -> None:
    """A launcher inside the job (a batch script's ``ringtrain run`` or torchrun; here one srun
    task): ``scancel`` signals every process of the job (proctrack follows the children), the
    launcher, its helpers and the ranks, and the launcher passes its own SIGTERM on at once.
    The ranks take the two as one notice, and ``ringtrain run``'s store and agent stay for
    them: they stop at one step, saved. (Before, the second SIGTERM unwound the ranks where
    they were, and the store ended on its own: no checkpoint at all.)"""
    if launcher == "torchrun":
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        command = [torchrun, "--standalone", "--nproc-per-node", "2", *DURABLE_JOB]
    else:
        command = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--", sys.executable]
        command += DURABLE_JOB
    rc, out, ck = _cancelled(local_slurm, tmp_path, ["-n", "1"], command)
    _saved_where_said(out, ck, "--resume" if launcher == "ringtrain-run" else "RINGTRAIN_RESUME=")
    if launcher == "ringtrain-run":
        assert "every rank stopped within the grace period of 20 s after SIGTERM at the step " \
               "the job saved" in out, out[-3000:]  # fmt: skip
    # torchrun ends on a signal with its SignalException's traceback, exit code 1.
    assert rc == (143 if launcher == "ringtrain-run" else 1), out[-3000:]
