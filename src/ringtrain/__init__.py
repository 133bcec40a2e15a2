"""ringtrain: distributed data-parallel training for PyTorch.

Layers, each importing only those below it (``|``: side by side, neither imports the other).
The import-linter contract in pyproject.toml holds this order; the README's "Layout" says more.

    torch | cli                        Horovod's names (``import ringtrain.torch as hvd``); the command
    bench | doctor | testing | deploy  what drives jobs: benchmarks, pre-flight checks, test harness
    elastic                            Horovod's elastic API: state, commit/restore, the retry loop
    lifecycle                          init/shutdown: the composition root (picks the backends)
    engine                             DistributedOptimizer: hooks, buckets, overlap
    collectives                        negotiated collectives, fusion, handles, autograd
    algorithms | diagnostics           process groups (hierarchical, sealed, TCP); job policies
    runtime                            launch environments, default group, topology, process sets
    compression | launch               plain tensor code; ``ringtrain run`` (never torch)
    security                           job keys, sealing, authenticated rendezvous (no torch)
    host                               facts about this host: interfaces, CPU limits
    config                             Config: every setting, with its RINGTRAIN_* twin
    environ                            the one table of environment variables
    errors | compat                    the exception tree; torch release differences

This facade sits beside the layers: it names the public API and imports nothing at run time.

The public names are loaded lazily on first use, so ``ringtrain run`` (which imports this package)
starts fast and works on a host without torch. ``tests/test_exports.py`` pins this surface.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # lifecycle and queries
    "init": "ringtrain.lifecycle",
    "shutdown": "ringtrain.lifecycle",
    "add_process_set": "ringtrain.lifecycle",
    "remove_process_set": "ringtrain.lifecycle",
    "start_timeline": "ringtrain.lifecycle",
    "straggler_report": "ringtrain.collectives.step_timing",
    "stop_timeline": "ringtrain.lifecycle",
    "is_initialized": "ringtrain.runtime.queries",
    "rank": "ringtrain.runtime.queries",
    "size": "ringtrain.runtime.queries",
    "local_rank": "ringtrain.runtime.queries",
    "local_size": "ringtrain.runtime.queries",
    "cross_rank": "ringtrain.runtime.queries",
    "cross_size": "ringtrain.runtime.queries",
    "is_homogeneous": "ringtrain.runtime.queries",
    "ProcessSet": "ringtrain.runtime.process_sets",
    "global_process_set": "ringtrain.runtime.state",
    "Config": "ringtrain.config",
    # collectives
    "allreduce": "ringtrain.collectives.ops",
    "allreduce_": "ringtrain.collectives.ops",
    "allreduce_async": "ringtrain.collectives.ops",
    "allreduce_async_": "ringtrain.collectives.ops",
    "grouped_allreduce": "ringtrain.collectives.ops",
    "grouped_allreduce_": "ringtrain.collectives.ops",
    "grouped_allreduce_async": "ringtrain.collectives.ops",
    "grouped_allreduce_async_": "ringtrain.collectives.ops",
    "allgather": "ringtrain.collectives.ops",
    "allgather_async": "ringtrain.collectives.ops",
    "grouped_allgather": "ringtrain.collectives.ops",
    "grouped_allgather_async": "ringtrain.collectives.ops",
    "broadcast": "ringtrain.collectives.ops",
    "broadcast_": "ringtrain.collectives.ops",
    "broadcast_async": "ringtrain.collectives.ops",
    "broadcast_async_": "ringtrain.collectives.ops",
    "reducescatter": "ringtrain.collectives.ops",
    "reducescatter_async": "ringtrain.collectives.ops",
    "grouped_reducescatter": "ringtrain.collectives.ops",
    "grouped_reducescatter_async": "ringtrain.collectives.ops",
    "alltoall": "ringtrain.collectives.ops",
    "alltoall_async": "ringtrain.collectives.ops",
    "poll": "ringtrain.collectives.ops",
    "synchronize": "ringtrain.collectives.ops",
    "broadcast_object": "ringtrain.collectives.objects",
    "allgather_object": "ringtrain.collectives.objects",
    "barrier": "ringtrain.collectives.objects",
    "join": "ringtrain.collectives.objects",
    "Handle": "ringtrain.collectives.handles",
    "ReduceOp": "ringtrain.collectives.reduce_ops",
    "Average": "ringtrain.collectives.reduce_ops",
    "Sum": "ringtrain.collectives.reduce_ops",
    "Min": "ringtrain.collectives.reduce_ops",
    "Max": "ringtrain.collectives.reduce_ops",
    "Product": "ringtrain.collectives.reduce_ops",
    "Adasum": "ringtrain.collectives.reduce_ops",
    # training
    "DistributedOptimizer": "ringtrain.engine.optimizer",
    "broadcast_parameters": "ringtrain.engine.state_sync",
    "broadcast_optimizer_state": "ringtrain.engine.state_sync",
    "SyncBatchNorm": "ringtrain.engine.sync_batch_norm",
    "Compression": "ringtrain.compression",
    # errors
    "RingtrainError": "ringtrain.errors",
    "CollectiveError": "ringtrain.errors",
    "CollectiveMismatchError": "ringtrain.errors",
    "CollectiveArgumentError": "ringtrain.errors",
    "StallError": "ringtrain.errors",
    "ConfigError": "ringtrain.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # let type checkers and IDEs see the real objects
    from ringtrain.collectives.handles import Handle
    from ringtrain.collectives.objects import allgather_object, barrier, broadcast_object, join
    from ringtrain.collectives.ops import (
        allgather,
        allgather_async,
        allreduce,
        allreduce_,
        allreduce_async,
        allreduce_async_,
        alltoall,
        alltoall_async,
        broadcast,
        broadcast_,
        broadcast_async,
        broadcast_async_,
        grouped_allgather,
        grouped_allgather_async,
        grouped_allreduce,
        grouped_allreduce_,
        grouped_allreduce_async,
        grouped_allreduce_async_,
        grouped_reducescatter,
        grouped_reducescatter_async,
        poll,
        reducescatter,
        reducescatter_async,
        synchronize,
    )
    from ringtrain.collectives.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
    from ringtrain.collectives.step_timing import straggler_report
    from ringtrain.compression import Compression
    from ringtrain.config import Config
    from ringtrain.engine.optimizer import DistributedOptimizer
    from ringtrain.engine.state_sync import broadcast_optimizer_state, broadcast_parameters
    from ringtrain.engine.sync_batch_norm import SyncBatchNorm
    from ringtrain.errors import (
        CollectiveArgumentError,
        CollectiveError,
        CollectiveMismatchError,
        ConfigError,
        RingtrainError,
        StallError,
    )
    from ringtrain.lifecycle import (
        add_process_set,
        init,
        remove_process_set,
        shutdown,
        start_timeline,
        stop_timeline,
    )
    from ringtrain.runtime.process_sets import ProcessSet
    from ringtrain.runtime.queries import (
        cross_rank,
        cross_size,
        is_homogeneous,
        is_initialized,
        local_rank,
        local_size,
        rank,
        size,
    )
    from ringtrain.runtime.state import global_process_set
