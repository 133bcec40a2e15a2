"""ringtrain on Ray clusters (``pip install ringtrain[ray]``).

* :class:`RingtrainConfig`: a Ray Train backend configuration; ``TorchTrainer(fn,
  torch_config=RingtrainConfig(...))`` starts ringtrain ranks (``hvd.init()`` in ``fn``).
* :class:`RayExecutor`: Horovod's ``horovod.ray.RayExecutor`` API; with ``min_workers`` an
  elastic job whose survivors re-form the world in their own processes when a worker dies.
* :class:`ElasticRayExecutor`: Horovod's ``horovod.ray.ElasticRayExecutor`` API; the same
  elastic job, and it grows onto Ray nodes' free slots (up to ``max_np``).

Layering: ``placement`` (pure: ranks from Ray nodes) < ``worker`` (runs in Ray workers) <
``backend`` (Ray Train) and ``executor`` (driver side; serves the store, announces worlds) <
``elastic`` (driver side; discovery of free slots, joiners).
The driver side imports no torch. See docs/engines.md.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    from ringtrain.errors import ConfigError

    raise ConfigError(f"ringtrain.ray needs Ray ({e}).\nHINT: pip install 'ringtrain[ray]'") from e

from ringtrain.ray.backend import RingtrainConfig
from ringtrain.ray.elastic import ElasticRayExecutor, ElasticSettings
from ringtrain.ray.executor import RayExecutor, Settings

__all__ = ["ElasticRayExecutor", "ElasticSettings", "RayExecutor", "RingtrainConfig", "Settings"]
