"""A checkpoint path built from the rank (``f"ckpt-{rank}"``): an error on every rank at once.

A save is one directory written by every rank together; before the paths were compared, rank 0
waited the whole ``timeout_s`` for parts written elsewhere, then blamed the file system, and
each rank left a ``.partial`` directory behind.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.errors import CheckpointError
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(120)
SAID = "a checkpoint is saved into one directory by every rank together, but the ranks gave "


def _save_per_rank(root: str, background: bool) -> tuple[str, float]:
    """Save into a directory of this rank's own; the error and how long it took to come."""
    model = torch.nn.Linear(2, 1)
    where = os.path.join(root, f"rank-{rt.rank()}")
    t0 = time.monotonic()
    try:
        if background:
            with ckpt.Checkpointer(where) as saver:
                saver.save(1, model=model)
        else:
            ckpt.save(os.path.join(where, "ckpt"), model=model, step=1)
    except CheckpointError as e:
        return str(e), time.monotonic() - t0
    return "", time.monotonic() - t0


@pytest.mark.parametrize("background", [False, True], ids=["save", "Checkpointer"])
def test_a_path_per_rank_is_an_error_on_every_rank(
    world2: spawn.World, tmp_path: Path, background: bool
) -> None:
    leaf = "" if background else "/ckpt"
    for error, took in world2.run(_save_per_rank, str(tmp_path), background):
        assert error == (
            f"{SAID}different paths:\n"
            f"  rank(s) 0: '{tmp_path}/rank-0{leaf}'\n"
            f"  rank(s) 1: '{tmp_path}/rank-1{leaf}'\n"
            "HINT: give every rank the same path (not one built from its rank); ringtrain "
            "writes each rank's part into it. Nothing was written."
        )
        assert took < 30, took  # not the job's timeout_s (300 s) of waiting for parts
    left = [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()]
    assert left == [] and not any(".partial" in p.name for p in tmp_path.rglob("*")), left
