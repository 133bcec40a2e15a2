"""``horovod.torch.elastic.sampler``'s name: ``ElasticSampler`` (:mod:`ringtrain.elastic.sampler`)."""

from __future__ import annotations

from ringtrain.elastic.sampler import ElasticSampler

__all__ = ["ElasticSampler"]
