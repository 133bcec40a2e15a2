"""A local-update optimizer (``sync_every``) is refused by ringtrain.checkpoint, on save and on
load, with what to do instead: its ranks' inner states differ between outer steps, and a
replicated copy would resume to other weights (see docs/checkpoint.md)."""

from __future__ import annotations

from pathlib import Path

import torch

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.errors import ConfigError
from ringtrain.testing import spawn


def _local_update_job(root: str) -> list[str]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        sync_every=2,
    )
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    errors = []
    try:
        ckpt.save(Path(root) / "local", model=model, optimizer=opt)
    except ConfigError as e:
        errors.append(str(e))
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = ckpt.save(Path(root) / "plain", model=model, optimizer=plain)
    try:
        ckpt.load(saved, model=model, optimizer=opt)
    except ConfigError as e:
        errors.append(str(e))
    return errors


def test_save_and_load_refuse_a_local_update_optimizer(tmp_path: Path, world2: spawn.World) -> None:
    for errors in world2.run(_local_update_job, str(tmp_path)):
        assert len(errors) == 2, errors
        for e in errors:
            assert "local-update optimizer (sync_every set)" in e and "HINT:" in e, e
    assert not (tmp_path / "local").exists()  # nothing half-written
