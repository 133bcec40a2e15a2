"""The classes behind each seam's protocol satisfy it; `make lint` runs mypy on this file.

Never run. A protocol's method that a class lacks or spells differently (a rename inside the
engine, a torch upgrade that changes a stub) fails the lint here, at the seam, rather than in a
spawned test. The protocols are those of ringtrain.runtime.contracts (what the layers above
pass around) and ringtrain.engine.stateful (what a checkpoint reads of the optimizer).
"""

from __future__ import annotations

import torch.distributed as dist

from ringtrain.engine.local_update import LocalUpdate
from ringtrain.engine.optimizer import DistributedOptimizer
from ringtrain.engine.sharded import ShardedStep
from ringtrain.engine.stateful import Checkpointable, HoldsShards, LocalState, Shards
from ringtrain.engine.steps import ShardedUpdate, WholeStep
from ringtrain.runtime.contracts import Group, Store, Work


def torch_objects(
    group: dist.ProcessGroup,
    store: dist.Store,
    tcp: dist.TCPStore,
    prefix: dist.PrefixStore,
    hashed: dist.HashStore,
    work: dist.Work,
) -> tuple[Group, list[Store], Work]:
    return group, [store, tcp, prefix, hashed], work


def engine_objects(
    optimizer: DistributedOptimizer,
    sharded: ShardedStep,
    local: LocalUpdate,
    steps: tuple[ShardedUpdate, WholeStep, LocalUpdate],
) -> tuple[Checkpointable, Shards, LocalState, list[HoldsShards]]:
    return optimizer, sharded, local, list(steps)
