"""A Ray Train backend that starts ringtrain ranks: ``TorchTrainer(..., torch_config=RingtrainConfig())``.

    from ray.train.torch import TorchTrainer
    from ringtrain.ray import RingtrainConfig

    def train_fn(config):
        import ringtrain.torch as hvd
        hvd.init()                   # rank, size, local and cross ranks as Ray Train placed them
        ...

    TorchTrainer(train_fn, torch_config=RingtrainConfig(network_interface="eth0", secure=True),
                 scaling_config=ScalingConfig(num_workers=4)).fit()

It replaces Ray's torch backend, so Ray creates no process group: ``hvd.init()`` builds
ringtrain's own (rank = Ray Train's world rank; rank 0 serves the rendezvous store on its node).
It also works with ``DataParallelTrainer(..., backend_config=RingtrainConfig())``.

Elastic: Ray Train's own (``ScalingConfig(num_workers=(min, max))``, ``FailureConfig``) restarts
the whole worker group after a failure; each new group is a fresh ringtrain job. For recovery
in the surviving processes use :class:`ringtrain.ray.RayExecutor` with ``min_workers``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from ray.train._internal.base_worker_group import BaseWorkerGroup
from ray.train.backend import Backend, BackendConfig
from ray.train.torch import TorchConfig

import ray
from ringtrain.ray import placement, worker
from ringtrain.security import keys


def _rank0_address() -> tuple[str, int]:
    """Rank 0's node address and a port free there, for the store rank 0 will serve."""
    from ringtrain.launch.rendezvous import free_port

    return ray.util.get_node_ip_address(), free_port()


@dataclass
class RingtrainConfig(TorchConfig):
    """Ray Train configuration that starts ringtrain ranks.

    ``network_interface``: interface(s) for ringtrain's traffic (``RINGTRAIN_NETWORK_INTERFACE``);
    ``secure``: seal every message (docs/security.md); the job key is ``key_file`` (a file on
    every node, mode 600) or, without one, a fresh key made for each worker group and handed to
    each worker through a pipe. That key travels over Ray's own connections: turn on Ray's TLS
    where the network between nodes is not trusted. ``settings``: any other ringtrain setting
    by its Config name (``{"straggler_report_steps": 50}``).
    """

    network_interface: str = ""
    secure: bool = False
    key_file: str = ""
    settings: dict[str, object] = field(default_factory=dict)

    @property
    def backend_cls(self) -> type[Backend]:
        return _RingtrainBackend

    def ringtrain_settings(self) -> dict[str, object]:
        out = dict(self.settings)
        if self.network_interface:
            out["network_interface"] = self.network_interface
        if self.secure:
            out["secure"] = True
        if self.key_file:
            out["key_file"] = self.key_file
        return out

    def to_dict(self) -> dict[str, Any]:
        # Ray exports this; the key file's path is fine to show, a key never is here.
        return {**super().to_dict(), **self.ringtrain_settings()}


class _RingtrainBackend(Backend):
    share_cuda_visible_devices = True  # as Ray's torch backend: ranks pick their local GPU

    def on_start(self, worker_group: BaseWorkerGroup, backend_config: BackendConfig) -> None:
        settings = cast(RingtrainConfig, backend_config).ringtrain_settings()
        common = placement.settings_environment(settings)
        reported = worker_group.execute(worker.facts)
        # Ranks follow the worker group's order: ray.train.get_context().get_world_rank() must
        # agree with hvd.rank(). Ray Train already groups a node's workers together.
        specs = placement.specs(reported)
        addr, port = worker_group.execute_single(0, _rank0_address)
        job_id = uuid.uuid4().hex[:16]
        key = None
        if settings.get("secure") and not settings.get("key_file"):
            key = keys.generate_job_key()
        futures = [
            worker_group.execute_single_async(
                spec.rank,
                worker.set_environment,
                {
                    **common,
                    **placement.rank_environment(spec, addr, port, job_id, store_hosted=False),
                },
                key,
            )
            for spec in specs
        ]
        # Ray's worker group returns ray.types.ObjectRef, which its ray.get is not typed to take.
        ray.get(futures)  # type: ignore[arg-type]

    # No on_shutdown: Ray Train ends the worker processes, and a group that lost a worker
    # could not shut down cleanly anyway (a clean ringtrain shutdown waits for every peer).
