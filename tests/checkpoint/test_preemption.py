"""A durable job's SIGTERM handling (``checkpoint/preemption.py``), in a process of its own:
the first SIGTERM asks the job to stop at its next step; a second unwinds, unless it comes
right after the first (the same notice, twice); a third ends the process; no step within the
time allowed unwinds the rank, even asleep in a blocking call."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _mpirun import mpirun_env
from ringtrain.checkpoint import preemption
from ringtrain.environ import OpenMPI

_SCRIPT = """
import os, signal, sys, time
from ringtrain.checkpoint import preemption
job = preemption.Preemption(within_s=float(sys.argv[1]))
job.install()
try:
    for what in sys.argv[2:]:
        if what == "final":  # for the unwinding
            continue
        if what == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(10_000))  # the handler runs between two bytecodes
        elif what == "closing":
            job.closing()
        elif what == "closed":
            job.closed()
        else:
            time.sleep(float(what))
        print(what, job.requested, flush=True)
finally:
    if "final" in sys.argv:  # a SIGTERM while the script unwinds (its with blocks wait)
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(10_000))
    print("unwound", flush=True)
"""


def _run(within_s: float, *steps: str) -> tuple[int, list[str], float]:
    t0 = time.monotonic()
    ran = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(within_s), *steps],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return ran.returncode, ran.stdout.splitlines(), time.monotonic() - t0


def test_the_first_sigterm_asks_a_second_unwinds_a_third_ends_the_process() -> None:
    rc, said, _ = _run(60.0, "term", "0.2")
    assert (rc, said) == (0, ["term True", "0.2 True", "unwound"])
    later = str(preemption.DUPLICATE_S + 0.5)
    rc, said, _ = _run(60.0, "term", later, "term", "0.2")
    assert (rc, said) == (143, ["term True", f"{later} True", "unwound"])
    rc, said, _ = _run(60.0, "term", later, "term", "final")
    assert (rc, said) == (-signal.SIGTERM, ["term True", f"{later} True"])


def test_a_second_sigterm_right_after_the_first_is_the_same_notice() -> None:
    """Slurm signals every process of a cancelled job, and the launcher passes its own on:
    two SIGTERMs a rank must take as one (unwound by the second, no rank saved the step)."""
    rc, said, _ = _run(60.0, "term", "0.3", "term", "0.2")
    assert (rc, said) == (0, ["term True", "0.3 True", "term True", "0.2 True", "unwound"])
    # The time to reach a step still ends it.
    rc, said, took = _run(1.0, "term", "0.3", "term", "30")
    assert (rc, said) == (143, ["term True", "0.3 True", "term True", "unwound"])
    assert took < 20, took


def test_under_mpirun_the_same_notice_comes_its_sigkill_timeout_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """mpirun passes a SIGTERM on ``odls_base_sigkill_timeout`` after its own (measured below),
    so under Slurm its ranks get Slurm's and, that long after, mpirun's."""
    assert preemption.duplicate_s() == preemption.DUPLICATE_S
    monkeypatch.setenv(OpenMPI.SIZE, "2")
    monkeypatch.setenv(OpenMPI.SIGKILL_TIMEOUT, "10")
    assert preemption.duplicate_s() == preemption.DUPLICATE_S + 10


@pytest.mark.parametrize("within_s", [0.5, 0.0])
def test_without_a_step_in_time_the_rank_unwinds_even_asleep(within_s: float) -> None:
    """No step (nothing calls ``stop()``) within ``within_s`` after the first SIGTERM: the main
    thread, asleep for 30 s, unwinds at the deadline; at 0 (no grace period), at once."""
    rc, said, took = _run(within_s, "term", "30")
    want = ["unwound"] if within_s == 0 else ["term True", "unwound"]
    assert (rc, said) == (143, want)
    assert took < 20, took  # not the 30 s sleep


def test_while_the_last_save_is_waited_for_a_sigterm_only_asks() -> None:
    """Closing (stopping, or ``close()`` waiting for the save): the first SIGTERM is noted and
    the wait goes on, past the deadline too; closed (nothing to wait for): it unwinds at once."""
    rc, said, _ = _run(0.3, "closing", "term", "1.0")
    assert (rc, said) == (0, ["closing False", "term True", "1.0 True", "unwound"])
    rc, said, _ = _run(60.0, "closed", "term", "1.0")
    assert (rc, said) == (143, ["closed False", "unwound"])


def test_a_later_durable_job_takes_sigterm_over_and_after_it_sigterm_unwinds() -> None:
    """Two durable jobs one after the other in one script (two phases): the second asks to
    stop on its first SIGTERM as the first did; between and after them, a SIGTERM unwinds."""
    script = """
import os, signal
from ringtrain.checkpoint import preemption
first = preemption.Preemption(within_s=60.0)
first.install()
first.closed()
second = preemption.Preemption(within_s=60.0)
second.install()
os.kill(os.getpid(), signal.SIGTERM)
sum(range(10_000))
print("second asked:", second.requested, flush=True)
second.closing()
second.closed()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    sum(range(10_000))
finally:
    print("unwound", flush=True)
"""
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (ran.returncode, ran.stdout) == (143, "second asked: True\nunwound\n"), ran.stderr


_DURABLE = """
import os, signal, sys
import torch
from ringtrain import Config
from ringtrain.checkpoint import durable, manifest
model = torch.nn.Linear(2, 2)
cfg = Config(checkpoint_dir=sys.argv[1], grace_period_s=8.0)
job = durable.Durable(model=model, config=cfg)
print("allowed", job._preemption.within_s, flush=True)  # half the grace period
job.step(1)  # no save due
os.kill(os.getpid(), signal.SIGTERM)
sum(range(10_000))
try:
    with job:
        job.step(2)
        print("went on", flush=True)
except SystemExit as stop:
    print("stopped", stop.code, job.stopped_at, flush=True)
print("saved", [s for s, _ in manifest.committed(sys.argv[1])], flush=True)
late = durable.Durable(model=model, config=Config(checkpoint_dir=sys.argv[2]))
late.step(1)
os.kill(os.getpid(), signal.SIGTERM)  # after the last step
sum(range(10_000))
try:
    late.close()
except SystemExit as stop:
    print("close raised", stop.code, flush=True)
"""


def test_a_durable_job_alone_stops_at_its_next_step_saved(tmp_path: Path) -> None:
    """One rank (no peers to agree with): the step after a SIGTERM is saved and the job stops
    there, within half the grace period; a SIGTERM after the last step is raised by
    ``close()``."""
    ran = subprocess.run(
        [sys.executable, "-c", _DURABLE, str(tmp_path / "a"), str(tmp_path / "b")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    said = ran.stdout.splitlines()
    assert said == ["allowed 4.0", "stopped 143 2", "saved [2]", "close raised 143"], ran.stderr


_SIGNALS = """
import signal, sys, time
from ringtrain.checkpoint import preemption
signal.signal(signal.SIGTERM, lambda *_: print("term", time.time(), flush=True))
print("ready", *preemption.launcher_grace_s(), flush=True)
while True:
    time.sleep(0.05)
"""


def _signalled(argv: list[str], ready: list[str], wait_s: float) -> tuple[float, float, str]:
    """Start ``argv``, a launcher of one rank running _SIGNALS, check the rank's ready line,
    SIGTERM the launcher: the seconds until the rank's SIGTERM and until the launcher's end,
    and what the rank said after its SIGTERM line."""
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=mpirun_env())
    try:
        assert launcher.stdout is not None
        assert launcher.stdout.readline().split() == ["ready", *ready]
        sent = time.time()
        launcher.send_signal(signal.SIGTERM)
        term = launcher.stdout.readline().split()
        rest = launcher.communicate(timeout=wait_s)[0]
        ended = time.time()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert term[0] == "term" and launcher.returncode != 0, (term, launcher.returncode)
    return float(term[1]) - sent, ended - sent, rest


def test_mpirun_passes_sigterm_on_after_its_timeout_and_sigkills_after_it_again() -> None:
    """What ``launcher_grace_s`` and docs/launch.md assume of Open MPI's mpirun, given SIGTERM
    with ``--mca odls_base_sigkill_timeout T``: the rank reads T, gets SIGTERM no sooner than T
    later, and is SIGKILLed (it ignores the SIGTERM) no sooner than 2T after mpirun's SIGTERM,
    so a preemption must leave the job 2T. Lower bounds only: load can only delay."""
    t = 3
    argv = ["mpirun", "-np", "1", "--mca", "odls_base_sigkill_timeout", str(t),
            sys.executable, "-c", _SIGNALS]  # fmt: skip
    term_s, end_s, rest = _signalled(argv, ["mpirun", f"{t:.1f}"], wait_s=60)
    assert term_s >= 0.9 * t and end_s >= 1.9 * t and "term" not in rest, (term_s, end_s, rest)


def test_torchrun_passes_sigterm_on_at_once_and_sigkills_30_s_after_it(tmp_path: Path) -> None:
    """What ``launcher_grace_s`` assumes of torchrun (torch.distributed.elastic's fixed shutdown
    timeout): the rank gets torchrun's SIGTERM at once and, ignoring it, SIGKILL no sooner than
    30 s later. Lower bounds (and a loose upper one for "at once"): load can only delay."""
    script = tmp_path / "signals.py"
    script.write_text(_SIGNALS)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
            "--standalone", str(script)]  # fmt: skip
    term_s, end_s, rest = _signalled(argv, ["torchrun", "30.0"], wait_s=90)
    assert term_s < 10 and end_s >= 29.5 and "term" not in rest, (term_s, end_s, rest)


@pytest.mark.parametrize(
    ("launcher", "env", "hint"),
    [
        ("mpirun", {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_odls_base_sigkill_timeout": "5"},
         "HINT: mpirun --mca odls_base_sigkill_timeout 40"),
        ("torchrun", {"TORCHELASTIC_RUN_ID": "r"}, "HINT: torchrun's time is fixed (40 s asked)"),
    ],
)  # fmt: skip
def test_under_a_launcher_that_kills_sooner_the_ranks_take_its_time_and_rank_0_says_so(
    launcher: str, env: dict[str, str], hint: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    from ringtrain.checkpoint import durable

    for name in (
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_MCA_odls_base_sigkill_timeout",
        "TORCHELASTIC_RUN_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    assert durable._grace_s(40.0, say=True) == 40.0 and not caplog.text
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    left = {"mpirun": 5.0, "torchrun": 30.0}[launcher]
    with caplog.at_level("WARNING", logger="ringtrain"):
        assert durable._grace_s(40.0, say=True) == left
        assert durable._grace_s(left, say=True) == left  # no shorter: nothing said
    assert caplog.text.count(f"under {launcher}, a SIGTERM") == 1 and hint in caplog.text
