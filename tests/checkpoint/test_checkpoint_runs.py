"""One directory, one run: a new job never removes or replaces another run's checkpoints.

Keep-last counts only the saving run's checkpoints; a save of a step that another run already
holds fails and leaves it; a resumed run continues its own series (its keep-last counts the
checkpoints it continues from); ``Durable`` refuses a directory that holds another run's
checkpoints. In one process (the whole job under ``ringtrain run``: test_checkpoint_durable.py).

The saves use the thread writer: what is tested here is the directory's rules, which both writers
apply through the same store.commit; a writer process would cost each Checkpointer a fresh
interpreter importing torch. (The process writer: test_checkpoint_async.py.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import manifest
from ringtrain.config import Config
from ringtrain.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(180)
WRITER = "thread"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 3)


def _steps(root: Path) -> list[int]:
    return [s for s, _ in manifest.committed(str(root))]


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file of every committed checkpoint under ``root``, by relative path."""
    out = {}
    for _, path in manifest.committed(str(root)):
        for name in os.listdir(path):
            out[os.path.join(os.path.basename(path), name)] = Path(path, name).read_bytes()
    return out


def _saves(root: Path, steps: list[int], keep: int, run: str | None = None) -> str:
    """Save ``steps`` with one Checkpointer; returns its run id."""
    with ckpt.Checkpointer(root, keep=keep, run=run, writer=WRITER) as saver:
        for step in steps:
            saver.save(step, model=_model(step))
            saver.wait()
        assert saver.run is not None
        return saver.run


def test_prune_counts_only_its_own_run(tmp_path: Path) -> None:
    for step, run in [(1, "a"), (2, "b"), (3, "a"), (4, "b"), (5, "a"), (6, None)]:
        d = tmp_path / manifest.step_name(step)
        d.mkdir()
        (d / manifest.MANIFEST).write_text(json.dumps({} if run is None else {"run": run}))
    assert manifest.prune(str(tmp_path), 1, run="a") == [
        str(tmp_path / manifest.step_name(s)) for s in (1, 3)
    ]
    assert _steps(tmp_path) == [2, 4, 5, 6]
    assert [s for s, _ in manifest.of_other_runs(str(tmp_path), "b")] == [5, 6]
    assert manifest.run_of(str(tmp_path / manifest.step_name(6))) == ""
    # A plain save(..., keep=K) knows no run: it counts every checkpoint, as documented.
    manifest.prune(str(tmp_path), 1)
    assert _steps(tmp_path) == [6]


def test_a_new_run_keeps_the_old_runs_checkpoints(tmp_path: Path) -> None:
    old = _saves(tmp_path, [6, 8, 10], keep=3)
    before = _snapshot(tmp_path)

    with ckpt.Checkpointer(tmp_path, keep=3, writer=WRITER) as saver:
        for step in (2, 4):
            saver.save(step, model=_model(100 + step))
            saver.wait()
        assert saver.run != old
        assert _steps(tmp_path) == [2, 4, 6, 8, 10]  # its own are not pruned for the old ones
        saver.save(6, model=_model(106))  # a step the old run holds
        with pytest.raises(CheckpointError, match="another run") as err:
            saver.wait()
        assert str(tmp_path / manifest.step_name(6)) in str(err.value)
        for step in (12, 14):
            saver.save(step, model=_model(100 + step))
            saver.wait()
    # keep=3 counted the new run's 2, 4, 12, 14 and removed 2; the old run's are as they were.
    assert _steps(tmp_path) == [4, 6, 8, 10, 12, 14]
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not [n for n in os.listdir(tmp_path) if "partial" in n or ".old-" in n]
    model = _model(0)
    assert ckpt.load(tmp_path / manifest.step_name(6), model=model).run == old
    assert torch.equal(model.weight, _model(6).weight)


def test_a_resumed_run_continues_its_own_series(tmp_path: Path) -> None:
    old = _saves(tmp_path, [2, 4, 6], keep=3)
    restored = ckpt.load(tmp_path, model=_model(0))
    assert (restored.step, restored.run) == (6, old)
    _saves(tmp_path, [8], keep=3, run=restored.run)
    assert _steps(tmp_path) == [4, 6, 8]  # the run goes on: its step 2 is the oldest of four


def test_durable_refuses_a_directory_of_another_run(tmp_path: Path) -> None:
    used, fresh, third = tmp_path / "used", tmp_path / "fresh", tmp_path / "third"
    old = _saves(used, [6, 8, 10], keep=3)
    before = _snapshot(used)

    new_job = Config(checkpoint_dir=str(used), checkpoint_every="2", checkpoint_writer=WRITER)
    with pytest.raises(ConfigError) as err:
        ckpt.Durable(model=_model(0), config=new_job)
    message = str(err.value)
    assert message.splitlines()[0] == (
        f"{used} holds 3 checkpoint(s) of another run (step 6, 8, 10), and this new job "
        "(no --resume) would delete or overwrite them."
    )
    assert f"--resume {used}" in message and "fresh directory" in message
    assert _snapshot(used) == before

    # Continuing that run, or a new run in a fresh directory, is what the error suggests.
    model = _model(0)
    with ckpt.Durable(
        model=model, config=Config(resume=str(used), checkpoint_every="2", checkpoint_writer=WRITER)
    ) as job:
        assert (job.start_step, job.run) == (10, old)
        assert torch.equal(model.weight, _model(10).weight)
        job.step(12)
    assert _steps(used) == [8, 10, 12]
    with ckpt.Durable(
        model=model, config=Config(checkpoint_dir=str(fresh), checkpoint_writer=WRITER)
    ) as job:
        assert job.start_step == 0
        job.step(2, force=True)
    assert _steps(fresh) == [2]

    # Resumed from one run, saving into a directory of another: refused as well.
    _saves(third, [4], keep=0)
    resumed_elsewhere = Config(
        resume=str(used), checkpoint_dir=str(third), checkpoint_writer=WRITER
    )
    with pytest.raises(ConfigError, match="than the one resumed from"):
        ckpt.Durable(model=_model(0), config=resumed_elsewhere)
    assert _steps(third) == [4]


def test_checkpoints_of_no_run(tmp_path: Path) -> None:
    """Saved by a plain ``save`` (or before runs were recorded): a new job refuses them, a job
    resumed from them continues them."""
    ckpt.save(tmp_path / manifest.step_name(2), model=_model(2), step=2)
    ckpt.save(tmp_path / manifest.step_name(4), model=_model(4), step=4)
    with pytest.raises(ConfigError, match=r"of another run \(step 2, 4\)"):
        ckpt.Durable(
            model=_model(0), config=Config(checkpoint_dir=str(tmp_path), checkpoint_writer=WRITER)
        )
    resumed = Config(
        resume=str(tmp_path), checkpoint_every="2", checkpoint_keep=2, checkpoint_writer=WRITER
    )
    with ckpt.Durable(model=_model(0), config=resumed) as job:
        assert (job.start_step, job.run) == (4, "")
        job.step(6)
    assert _steps(tmp_path) == [4, 6]
    assert manifest.run_of(str(tmp_path / manifest.step_name(6))) == ""


def test_resumed_from_an_earlier_step_the_job_saves_beside_it(tmp_path: Path) -> None:
    """The newest checkpoint damaged: its error names the earlier ones and how to resume from
    one; resumed from ``root/step-N``, the job keeps saving into ``root`` (not inside the step),
    and its save of the damaged step replaces it."""
    run = _saves(tmp_path, [2, 4, 6], keep=0)
    newest = tmp_path / manifest.step_name(6)
    data = next(p for p in newest.iterdir() if p.name.endswith(".distcp"))
    data.write_bytes(b"\0" + data.read_bytes()[1:])
    earlier = tmp_path / manifest.step_name(4)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(tmp_path, model=_model(0))
    assert str(err.value).splitlines()[-1] == (
        f"Earlier checkpoints beside it: step 4 ({earlier}), step 2 "
        f"({tmp_path / manifest.step_name(2)}). Load one by its directory; to resume a job from "
        f"it: ringtrain run --resume {earlier} (it keeps saving into {tmp_path})."
    )
    resumed = Config(resume=str(earlier), checkpoint_every="2", checkpoint_writer=WRITER)
    model = _model(0)
    with ckpt.Durable(model=model, config=resumed) as job:
        assert (job.start_step, job.run, job.directory) == (4, run, str(tmp_path))
        job.step(6)
    assert _steps(tmp_path) == [2, 4, 6] and _steps(earlier) == []
    assert ckpt.load(tmp_path, model=_model(0)).step == 6
