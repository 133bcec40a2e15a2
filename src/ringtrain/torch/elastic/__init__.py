"""``horovod.torch.elastic`` (also ``hvd.elastic``): ringtrain's elastic API under Horovod's path.

Every name is :mod:`ringtrain.elastic`'s object; see that package and docs/elastic.md. Horovod's
submodules are here too: ``sampler`` (``ElasticSampler``) and ``state`` (``TorchState``).
"""

from __future__ import annotations

from ringtrain.elastic import (
    ElasticSampler,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    TorchState,
    run,
)

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]
