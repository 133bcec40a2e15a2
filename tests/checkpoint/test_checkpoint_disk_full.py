"""A full disk during a save: an error that names the file and says "no space left on device"
(errno ENOSPC), and the earlier checkpoint stays whole and loadable.

On a small tmpfs mounted for the test (as root; skipped otherwise, or where mounting fails),
filled after the first save: blocking saves in one process and at 2 ranks, an asynchronous save,
and a durable job under ``ringtrain run``. One more test, which needs no mount, makes the commit
itself (rank 0's manifest) fail the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import manifest
from ringtrain.errors import CheckpointError
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(300)
JOB = str(Path(__file__).with_name("durable_job.py"))
NO_SPACE = "no space left on device"


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, unmounted after the test whatever happened."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "disk"
    where.mkdir()
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(where)], check=True, timeout=30)  # still busy


def _fill(disk: Path) -> None:
    """Take every free byte of ``disk``."""
    with open(disk / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:  # unbuffered: closing has nothing left to write
            f.write(b"\0" * (1 << 16))
    assert os.statvfs(disk).f_bavail == 0


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _assert_named(message: str, disk: Path) -> None:
    assert NO_SPACE in message and "ENOSPC" in message, message
    assert f"could not write {disk}/.step-000000002.partial-" in message, message
    assert ".distcp" in message.splitlines()[0], message


def _earlier_loads(disk: Path) -> None:
    """The first save is the newest complete checkpoint, whole, with its weights."""
    model = _model(0)
    restored = ckpt.load(disk, model=model)
    assert restored.step == 1 and restored.directory == str(disk / manifest.step_name(1))
    assert _same(model, _model(1))
    # This save's own files are gone (their space free again); only empty directories stay.
    partial = [n for n in os.listdir(disk) if "partial" in n]
    assert all(not os.listdir(disk / n) for n in partial), partial


def test_blocking_save_on_a_full_disk(disk: Path) -> None:
    ckpt.save(disk / manifest.step_name(1), model=_model(1), step=1)
    _fill(disk)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(disk / manifest.step_name(2), model=_model(2), step=2)
    _assert_named(str(err.value), disk)
    cause = err.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    _earlier_loads(disk)


def test_background_save_on_a_full_disk(disk: Path) -> None:
    with ckpt.Checkpointer(disk, keep=3) as saver:
        saver.save(1, model=_model(1))
        saver.wait()
        _fill(disk)
        saver.save(2, model=_model(2))
        with pytest.raises(CheckpointError) as err:
            saver.wait()
    message = str(err.value)
    _assert_named(message, disk)
    assert message.count("HINT:") == 1, message
    _earlier_loads(disk)


def _save_at(path: str, step: int) -> str | None:
    """On every rank: save; the error's text if the save failed."""
    try:
        ckpt.save(path, model=_model(step), step=step)
    except CheckpointError as e:
        return str(e)
    return None


def test_two_ranks_on_a_full_disk(disk: Path, world2: spawn.World) -> None:
    assert world2.run(_save_at, str(disk / manifest.step_name(1)), 1) == [None, None]
    _fill(disk)
    errors = world2.run(_save_at, str(disk / manifest.step_name(2)), 2)
    for message in errors:  # each rank's own write failed, or it names the rank whose did
        assert message is not None
        _assert_named(message, disk)
    _earlier_loads(disk)


def test_commit_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt.save(tmp_path / manifest.step_name(1), model=_model(1), step=1)

    def full(directory: str, *_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as json.dump's write says it

    monkeypatch.setattr(manifest, "write", full)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(tmp_path / manifest.step_name(2), model=_model(2), step=2)
    first = str(err.value).splitlines()[0]
    assert f"could not write {tmp_path}/.step-000000002.partial-" in first
    assert f"/{manifest.MANIFEST} " in first and NO_SPACE in first
    monkeypatch.undo()
    _earlier_loads(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]  # the whole save removed


def test_durable_job_on_a_full_disk(disk: Path, tmp_path: Path) -> None:
    """Under ``ringtrain run``: the failed save's error reaches the output, naming the file, the
    job ends within seconds of it (the failing rank leaves at once: tests/launch/
    test_failing_rank.py; 20 s allows for a loaded machine), and the checkpoint saved before
    the disk filled stays loadable."""
    log = tmp_path / "job.log"
    argv = [
        sys.executable, "-m", "ringtrain", "run", "-np", "2",
        "--checkpoint-dir", str(disk), "--checkpoint-every", "2",
        "--", sys.executable, JOB, str(tmp_path / "out.pt"), "40", "0.25",
    ]  # fmt: skip
    with open(log, "wb") as out:
        launcher = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not manifest.committed(str(disk)):
            assert launcher.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no checkpoint in time\n" + log.read_text()
            time.sleep(0.1)
        _fill(disk)
        while NO_SPACE not in log.read_text():
            assert time.monotonic() < deadline, "no disk-full error\n" + log.read_text()
            time.sleep(0.2)
        named = time.monotonic()
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.wait(60)
        ended = time.monotonic() - named
    finally:
        if launcher.poll() is None:
            family = psutil.Process(launcher.pid).children(recursive=True)
            launcher.kill()  # the launcher's death ends every rank (test_checkpoint_durable.py)
            launcher.wait()
        _, alive = psutil.wait_procs(family, timeout=60)
        for p in alive:
            p.kill()
    text = log.read_text()
    assert launcher.returncode != 0, text
    assert ended < 20.0, f"the job ended {ended:.1f} s after the disk-full error\n{text}"
    assert f"could not write {disk}/.step-" in text and "(ENOSPC)" in text, text
    assert not (tmp_path / "out.pt").exists()
    saved = manifest.committed(str(disk))
    restored = ckpt.load(disk)  # verified whole: every file's size and SHA-256
    assert (restored.step, restored.directory) == (saved[-1][0], saved[-1][1])
