"""An ``extra`` that cannot be pickled (a lambda, a lock): an error on every rank at once.

Only rank 0 writes ``extra``; before every rank checked it, rank 0 alone raised pickle's error
while writing and a script that caught it went on into its next collective, while the other
ranks waited in the save for rank 0's word until ``timeout_s``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.errors import CheckpointError
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(120)


def _save_bad_extra(root: str, background: bool, what: str) -> tuple[str, float]:
    """Save with an unpicklable extra, catch the error, then run a collective: the error and
    the collective's sum (the job goes on)."""
    model = torch.nn.Linear(2, 1)
    extra = {"schedule": lambda step: step} if what == "lambda" else {"lock": threading.Lock()}
    error = ""
    try:
        if background:
            with ckpt.Checkpointer(root) as saver:
                saver.save(1, model=model, extra=extra)
        else:
            ckpt.save(f"{root}/step-1", model=model, extra=extra, step=1)
    except CheckpointError as e:
        error = str(e)
    return error, float(rt.allreduce(torch.ones(1), op=rt.Sum))


@pytest.mark.parametrize("what", ["lambda", "lock"])
@pytest.mark.parametrize("background", [False, True], ids=["save", "Checkpointer"])
def test_an_unpicklable_extra_is_an_error_on_every_rank(
    world2: spawn.World, tmp_path: Path, background: bool, what: str
) -> None:
    for error, total in world2.run(_save_bad_extra, str(tmp_path), background, what):
        assert error.startswith("extra cannot be saved: it must be picklable, and pickle says ")
        assert error.endswith(
            "not lambdas, local functions, locks or open files. Nothing was written."
        )
        assert total == 2.0
    left = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")]
    assert left == [], left


def _save_failing_on_rank1(root: str) -> str:
    """Rank 1's write fails with something other than an OSError: a defect, as every rank
    hears it."""
    from ringtrain.checkpoint import store

    def broken(*_: object) -> None:
        raise RuntimeError("planted failure")

    kept = store.write_part
    if rt.rank() == 1:
        store.write_part = broken  # this world's ranks run later tests: put back below
    try:
        ckpt.save(f"{root}/step-1", model=torch.nn.Linear(2, 1), step=1)
    except CheckpointError as e:
        return str(e)
    finally:
        store.write_part = kept
    return ""


def test_any_failure_of_one_ranks_write_reaches_every_rank(
    world2: spawn.World, tmp_path: Path
) -> None:
    where = f"{tmp_path}/step-1"
    rank0, rank1 = world2.run(_save_failing_on_rank1, str(tmp_path))
    assert rank1 == (
        f"could not write the checkpoint {where}: planted failure.\nHINT: its cause, a "
        "RuntimeError, is shown above; earlier checkpoints are untouched."
    )
    assert rank0 == f"writing the checkpoint {where} failed on rank 1: {rank1}"
