"""``--checkpoint-every 300s``: a schedule in seconds follows rank 0's clock, agreed every few
steps (here every step: rank 0's steps take 0.4 s, longer than the 0.25 s between checks), so
every rank saves at the same steps whatever its own clock says (docs/checkpoint.md). The clocks
are made by hand: rank 0's moves 0.4 s a step, rank 1's stands still. A check's answer is read
at the next check, and an interval counts from the last save: rank 0's clock says "due" at
steps 3 and 7, and the ranks save at 4 and 8."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

import ringtrain as rt
from ringtrain.checkpoint import durable
from ringtrain.testing.spawn import World


def _saves(directory: str) -> list[int]:
    ticks = [0.0]

    def clock() -> float:
        return ticks[0]

    real = durable.time
    durable.time = SimpleNamespace(monotonic=clock)  # type: ignore[assignment]
    try:
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = rt.Config(checkpoint_dir=directory, checkpoint_every="1s")
        saved = []
        with durable.Durable(model=model, optimizer=opt, config=cfg) as job:
            for step in range(1, 11):
                if rt.rank() == 0:
                    ticks[0] += 0.4
                if job.step(step):
                    saved.append(step)
        return saved
    finally:
        durable.time = real


def test_a_schedule_in_seconds_follows_rank_0s_clock(world2: World, tmp_path: Path) -> None:
    assert world2.run(_saves, str(tmp_path / "ck")) == [[4, 8], [4, 8]]
