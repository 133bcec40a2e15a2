"""``horovod.torch.optimizer``'s name: ``DistributedOptimizer`` (ringtrain's engine)."""

from __future__ import annotations

from ringtrain.engine.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
