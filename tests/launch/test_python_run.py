"""``ringtrain.run(func, ...)``: Horovod's ``horovod.run`` on ringtrain's launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ringtrain
from ringtrain.checkpoint import manifest
from ringtrain.launch.python_run import MAX_PAYLOAD

pytestmark = pytest.mark.timeout(240)


def test_each_rank_returns_its_result() -> None:
    def train(scale: int, *, offset: int = 0) -> tuple[int, int, float]:
        import torch

        import ringtrain.torch as hvd

        hvd.init()
        total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
        return hvd.rank() * scale + offset, hvd.size(), float(total)

    got = ringtrain.run(train, args=(10,), kwargs={"offset": 1}, np=2)
    assert got == [(1, 2, 1.0), (11, 2, 1.0)]


def test_a_rank_that_raises_fails_the_call_as_horovod_run_does(capfd) -> None:
    def train() -> None:
        import os

        if os.environ["RINGTRAIN_RANK"] == "1":
            raise ValueError("no data on rank 1")

    with pytest.raises(RuntimeError, match="failed with exit code 1") as caught:
        ringtrain.run(train, num_proc=2)
    assert isinstance(caught.value, ringtrain.JobFailedError)
    # The rank's traceback names this file and quotes the line, though cloudpickle sends the
    # function by value with "<dynamic-code>" for its file: the launcher sends the file along.
    code = train.__code__
    err = capfd.readouterr().err
    assert f'File "{code.co_filename}", line {code.co_firstlineno + 4}, in train' in err, err
    assert 'raise ValueError("no data on rank 1")' in err and "<dynamic-code>" not in err


def test_a_preempted_durable_job_raises_job_preempted_and_runs_on_from_its_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A preemption is no failure: every rank saved the step the job stopped at. So the call
    raises JobPreemptedError (still a JobFailedError, a RuntimeError, as horovod.run raises for
    any job that did not end well) with the way on; run again with RINGTRAIN_RESUME, the job
    starts at that step on every rank."""

    def durable(total: int, stop_at: int) -> tuple[int, int]:
        # Directory and schedule from the environment; rank 1 sends itself SIGTERM after step
        # stop_at, as a preemption does. Nested: cloudpickle sends it by value.
        import os
        import signal
        import time

        import torch

        import ringtrain as rt
        import ringtrain.checkpoint as ckpt

        rt.init()
        model = torch.nn.Linear(4, 1)
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        with ckpt.Durable(model=model, optimizer=opt) as job:
            first = job.start_step
            for step in range(first, total):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                job.step(step + 1)
                if step + 1 == stop_at and rt.rank() == 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.02)
        return first, total

    ck = tmp_path / "ck"
    monkeypatch.setenv("RINGTRAIN_CHECKPOINT_DIR", str(ck))
    monkeypatch.setenv("RINGTRAIN_CHECKPOINT_EVERY", "1000")  # no save due on the schedule
    with pytest.raises(ringtrain.JobPreemptedError, match="stopped on a preemption") as caught:
        ringtrain.run(durable, args=(400, 3), np=2)
    assert isinstance(caught.value, ringtrain.JobFailedError)
    assert caught.value.exit_code == 143
    assert "RINGTRAIN_RESUME" in str(caught.value)
    assert "job stopped on a preemption" in capfd.readouterr().err
    monkeypatch.delenv("RINGTRAIN_CHECKPOINT_DIR")
    monkeypatch.setenv("RINGTRAIN_RESUME", str(ck))
    resumed = ringtrain.run(durable, args=(400, 0), np=2)
    starts = {first for first, _ in resumed}
    assert len(starts) == 1 and 3 < starts.pop() < 400, resumed


_CALLER = """
import time

import ringtrain


def durable() -> None:
    import torch

    import ringtrain as rt
    import ringtrain.checkpoint as ckpt

    rt.init()
    model = torch.nn.Linear(4, 1)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    with ckpt.Durable(model=model, optimizer=opt) as job:
        print(f"rank {rt.rank()} starts", flush=True)
        for step in range(job.start_step, 100_000):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            job.step(step + 1)
            time.sleep(0.02)


try:
    ringtrain.run(durable, np=2)
except ringtrain.JobFailedError as e:
    print(f"raised {type(e).__name__} {e.exit_code}", flush=True)
"""


def test_a_preemption_of_the_calling_process_raises_job_preempted(tmp_path: Path) -> None:
    """SIGTERM to the process that called ``ringtrain.run`` (its machine is preempted): the
    call forwards it to the ranks, which save the step they stop at, and raises
    JobPreemptedError, as where the ranks alone were signalled."""
    caller = tmp_path / "caller.py"
    caller.write_text(_CALLER)
    env = {**os.environ, "RINGTRAIN_CHECKPOINT_DIR": str(tmp_path / "ck")}
    env["RINGTRAIN_CHECKPOINT_EVERY"] = "1000"  # no save due on the schedule
    proc = subprocess.Popen(
        [sys.executable, str(caller)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        started = 0
        while started < 2:
            line = proc.stdout.readline()
            assert line, "the job ended before its ranks started"
            started += "starts" in line
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "raised JobPreemptedError 143" in out, out + err[-3000:]
    assert "job terminated (SIGTERM): every rank stopped within the grace period" in err, err
    assert "at the step the job saved (to continue, run the job again with --resume" in err
    assert [s for s, _ in manifest.committed(str(tmp_path / "ck"))], err[-3000:]


def test_the_files_go_back_into_the_function_and_the_code_nested_in_it() -> None:
    import pickle

    import cloudpickle

    from ringtrain.launch import code_files

    def outer() -> tuple[list[int], int]:
        return [len(x) for x in ("ab",)], (lambda: 1)()

    got, files = pickle.loads(cloudpickle.dumps((outer, code_files.files_of(outer))))
    code_files.restore(got, files)
    nested = [c for c in got.__code__.co_consts if hasattr(c, "co_filename")]
    assert nested and got() == outer()
    assert {c.co_filename for c in [got.__code__, *nested]} == {outer.__code__.co_filename}


def test_arguments_horovod_run_refuses_or_ringtrain_cannot_honour() -> None:
    with pytest.raises(ringtrain.ConfigError, match="hosts or hostfile"):
        ringtrain.run(print, hosts="localhost:2", hostfile="hosts.txt")
    for mpi in ({"use_mpi": True}, {"mpi_args": "-x FOO"}):
        with pytest.raises(ringtrain.ConfigError, match=r"use_mpi/mpi_args") as refused:
            ringtrain.run(print, np=2, **mpi)
        _assert_hint_on_its_own_line(str(refused.value))
    with pytest.raises(ringtrain.ConfigError, match=r"more than a command line") as too_big:
        ringtrain.run(print, args=(b"x" * MAX_PAYLOAD,), np=2)
    _assert_hint_on_its_own_line(str(too_big.value))


def _assert_hint_on_its_own_line(message: str) -> None:
    assert "\\n" not in message  # a real newline, not a backslash and an n
    assert [x for x in message.splitlines() if x.startswith("HINT: ")], message


# pytorch_mnist.py's shape: a main() in the script's __main__, started with --num-proc.
SCRIPT = textwrap.dedent(
    """
    import argparse
    import ringtrain

    def main(args):
        import ringtrain.torch as hvd
        hvd.init()
        print(f"training on rank {hvd.rank()}", flush=True)
        return hvd.rank() + args.base

    if __name__ == "__main__":
        p = argparse.ArgumentParser()
        p.add_argument("--num-proc", type=int)
        p.add_argument("--base", type=int, default=100)
        args = p.parse_args()
        print("results", ringtrain.run(main, args=(args,), np=args.num_proc))
    """
)


def test_a_script_runs_its_main_on_num_proc_ranks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), "--num-proc", "2"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "results [100, 101]" in done.stdout
    assert "[1] training on rank 1" in done.stdout  # the ranks' own output, prefixed
    assert "ringtrain-result" not in done.stdout  # the results' lines are not printed
