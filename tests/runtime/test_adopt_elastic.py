"""An elastic job's ranks refuse a process group the script created (docs/engines.md): the
launcher re-forms the world when a rank fails, and an adopted group cannot follow. The first
world's ranks (started with ``RINGTRAIN_ELASTIC_ID``, not joining) refuse it too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch.distributed as dist

import ringtrain as rt
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World


def _adopt_in_elastic_job(path: str) -> str:
    rank, size = int(os.environ["RINGTRAIN_RANK"]), int(os.environ["RINGTRAIN_SIZE"])
    dist.init_process_group("gloo", store=dist.FileStore(path, size), rank=rank, world_size=size)
    try:
        with pytest.raises(ConfigError) as e:
            rt.init()
        return str(e.value).splitlines()[0]
    finally:
        dist.destroy_process_group()


def test_an_elastic_rank_refuses_the_scripts_group(world2: World, tmp_path: Path) -> None:
    env = [{"RINGTRAIN_ELASTIC_ID": str(r)} for r in range(2)]
    said = world2.run(_adopt_in_elastic_job, str(tmp_path / "store"), env=env, init=False)
    assert (
        said
        == [
            "an elastic job cannot adopt the process group this script created: "
            "ringtrain re-forms the world when a rank fails, and that group cannot "
            "follow."
        ]
        * 2
    )
