"""``horovod.torch.sync_batch_norm``'s name: ``SyncBatchNorm`` (statistics over every rank)."""

from __future__ import annotations

from ringtrain.engine.sync_batch_norm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
