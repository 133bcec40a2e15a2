"""Asynchronous saves: written by a writer process while training goes on, from a snapshot
taken when save() returned; one in flight; a failed write raised at the next save or wait."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import manifest, process_writer
from ringtrain.errors import CheckpointError
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(600)


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))


def test_background_process_writes_the_snapshot(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    snapshots = []
    with ckpt.Checkpointer(tmp_path, keep=2) as saver:
        for step in range(1, 4):
            model(torch.ones(2, 32)).sum().backward()
            opt.step()
            saver.save(step, model=model, optimizer=opt, extra={"step": step})
            assert saver.writer_pid is not None and saver.writer_pid != os.getpid()
            snapshots.append([p.detach().clone() for p in model.parameters()])
            with torch.no_grad():  # training goes on while the write runs
                for p in model.parameters():
                    p.add_(1.0)
        assert saver.wait() == os.path.join(str(tmp_path), manifest.step_name(3))
        assert saver.last_blocked_s > 0
        # The writer runs below training's CPU and I/O priority, so a busy host's cores go to
        # the steps first (the benchmark's slowdown figure depends on it); it set them at its
        # first write.
        writer_proc = psutil.Process(saver.writer_pid)
        assert writer_proc.nice() == min(19, psutil.Process().nice() + process_writer.NICE)
        assert tuple(writer_proc.ionice()) == (psutil.IOPRIO_CLASS_BE, 7)
    assert [s for s, _ in manifest.committed(str(tmp_path))] == [2, 3]
    fresh = _model()
    restored = ckpt.load(tmp_path, model=fresh)
    assert restored.step == 3 and restored.extra == {"step": 3}
    assert all(torch.equal(a, b) for a, b in zip(snapshots[-1], fresh.parameters()))


_KILLED = """
import os, signal, sys, torch
import ringtrain.checkpoint as ckpt
saver = ckpt.Checkpointer(sys.argv[1])
saver.save(1, model=torch.nn.Linear(64, 64))
saver.wait()
print(saver.buffer_dir, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_buffers_of_a_killed_process_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 leaves the shared-memory buffers (a copy of the rank's part) behind; the next
    Checkpointer with the same buffer directory removes them, and never a live one's."""
    # A directory of the test's own: in /dev/shm, another test's Checkpointer on this machine
    # may sweep the dead one's buffers before this one looks (as it should: CI saw it).
    shm = tmp_path / "shm"
    monkeypatch.setenv("RINGTRAIN_CHECKPOINT_BUFFERS", str(shm))
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED, str(tmp_path / "a")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = proc.stdout.strip()
    assert os.path.dirname(left) == str(shm)
    assert os.path.isdir(left) and os.listdir(left)
    with ckpt.Checkpointer(tmp_path / "b") as live, ckpt.Checkpointer(tmp_path / "c") as other:
        live.save(1, model=_model())
        assert not os.path.exists(left)
        mine = live.buffer_dir
        assert mine is not None
        other.save(1, model=_model())  # sweeps again: the live one's buffers stay
        assert os.path.isdir(mine) and other.buffer_dir != mine
    assert not os.path.exists(mine)


_FULL = """
import sys, torch
import ringtrain.checkpoint as ckpt
from ringtrain.errors import CheckpointError
with ckpt.Checkpointer(sys.argv[1], writer="process") as saver:
    try:
        saver.save(1, model=torch.nn.Linear(256, 512))  # 0.5 MiB of buffers
    except CheckpointError as e:
        print(e, flush=True)
    saver.save(2, model=torch.nn.Linear(64, 64))  # 16 KiB: fits
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="mounts a small tmpfs in a mount namespace of its own: needs root and unshare",
)
def test_a_full_buffer_directory_is_an_error_that_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A /dev/shm too small for the rank's part (Docker's default is 64 MiB) killed the rank
    with SIGBUS at the first write into the mapping (exit code 135, no words). Now save()
    says what is full and what to do, and a save that fits goes on."""
    small = tmp_path / "small"
    small.mkdir()
    monkeypatch.setenv("RINGTRAIN_CHECKPOINT_BUFFERS", str(small))
    script = f'mount -t tmpfs -o size=256k tmpfs {small} && exec {sys.executable} -c "$0" "$1"'
    proc = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, _FULL, str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    said = proc.stdout
    assert f"no room for this rank's checkpoint buffer in {small}: it needs 0.5 MiB" in said
    assert "RINGTRAIN_CHECKPOINT_BUFFERS" in said and "--shm-size" in said
    assert [s for s, _ in manifest.committed(str(tmp_path / "ck"))] == [2]


_UNCLOSED = """
import sys, torch
import ringtrain.checkpoint as ckpt
saver = ckpt.Checkpointer(sys.argv[1], writer=sys.argv[2])
saver.save(1, model=torch.nn.Linear(256, 256))
print(saver.buffer_dir, flush=True)
"""  # and the script ends: no close(), no wait(), no with-block


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_a_save_in_flight_when_the_script_ends_is_committed(tmp_path: Path, kind: str) -> None:
    """A script that saves at its last step and ends without close(): the exit waits for the
    save in flight, as Python waits for a ThreadPoolExecutor's work. It ended with code 0 and
    that save left only a partial directory (the writer died with the process), its buffers
    kept in /dev/shm until the next Checkpointer on the machine."""
    proc = subprocess.run(
        [sys.executable, "-c", _UNCLOSED, str(tmp_path), kind],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [s for s, _ in manifest.committed(str(tmp_path))] == [1], os.listdir(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]
    if kind == "process":
        assert not os.path.exists(proc.stdout.strip())  # its buffers were freed


def test_failed_write_is_raised_at_the_next_save(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    model = _model()
    with ckpt.Checkpointer(blocker / "ck") as saver:
        saver.save(1, model=model)  # returns: the write fails in the background
        with pytest.raises(CheckpointError, match=r"background save into .*step-000000001 failed"):
            saver.save(2, model=model)
        saver.save(3, model=model)
        with pytest.raises(CheckpointError, match="step-000000003 failed"):
            saver.wait()


def test_dead_writer_is_a_failure(tmp_path: Path) -> None:
    model = _model()
    with ckpt.Checkpointer(tmp_path) as saver:
        saver.save(1, model=model)
        pid = saver.writer_pid
        assert pid is not None
        os.kill(pid, 9)  # long before it has imported torch, let alone written
        with pytest.raises(CheckpointError, match="writer process died"):
            saver.save(2, model=model)
        saver.save(3, model=model)  # a new writer is started for it
        assert saver.wait() is not None
    assert [s for s, _ in manifest.committed(str(tmp_path))] == [3]
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]


def _async_at_two(root: str) -> list[Any]:
    model = _model()
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters()),
        named_parameters=model.named_parameters(),
        shard_optimizer=True,
    )
    with ckpt.Checkpointer(root, keep=1) as saver:
        for step in range(1, 3):
            opt.zero_grad()
            model(torch.ones(2, 32) * (rt.rank() + 1)).sum().backward()
            opt.step()
            saver.save(step, model=model, optimizer=opt)
        saver.wait()
    return [p.detach().clone() for p in model.parameters()]


def test_async_sharded_at_two_ranks(tmp_path: Path, world2: spawn.World) -> None:
    want = world2.run(_async_at_two, str(tmp_path))
    assert [s for s, _ in manifest.committed(str(tmp_path))] == [2]
    fresh = _model()
    ckpt.load(tmp_path, model=fresh)
    assert all(torch.equal(a, b) for a, b in zip(want[0], fresh.parameters()))
