"""ringtrain: distributed data-parallel training for PyTorch.

Layers, each importing only those below it (``|``: side by side, neither imports the other).
The import-linter contract in pyproject.toml holds this order; the README's "Layout" says more.

    torch | cli                        Horovod's names (``import ringtrain.torch as hvd``); the command
    bench | doctor | testing | deploy  what drives jobs: benchmarks, pre-flight checks, test harness
    elastic                            Horovod's elastic API: state, commit/restore, the retry loop
    lifecycle                          init/shutdown: the composition root (picks the backends)
    engine                             DistributedOptimizer: hooks, buckets, overlap
    collectives                        negotiated collectives, fusion, handles, autograd
    transport                          the wire: every group's ops; the ring, sealed and TCP groups
    diagnostics                        the policies a running job uses
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
    # horovod.run: a function on every rank of a job that ringtrain's launcher starts
    "run": "ringtrain.launch.python_run",
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
    "join": "ringtrain.engine.state_sync",
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
    "PeerFailedError": "ringtrain.errors",
    "JobFailedError": "ringtrain.errors",
    "JobPreemptedError": "ringtrain.errors",
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


if TYPE_CHECKING:  # type checkers and IDEs see the real objects ("X as X": re-exported)
    from ringtrain.collectives.handles import Handle as Handle
    from ringtrain.collectives.objects import allgather_object as allgather_object
    from ringtrain.collectives.objects import barrier as barrier
    from ringtrain.collectives.objects import broadcast_object as broadcast_object
    from ringtrain.collectives.ops import allgather as allgather
    from ringtrain.collectives.ops import allgather_async as allgather_async
    from ringtrain.collectives.ops import allreduce as allreduce
    from ringtrain.collectives.ops import allreduce_ as allreduce_
    from ringtrain.collectives.ops import allreduce_async as allreduce_async
    from ringtrain.collectives.ops import allreduce_async_ as allreduce_async_
    from ringtrain.collectives.ops import alltoall as alltoall
    from ringtrain.collectives.ops import alltoall_async as alltoall_async
    from ringtrain.collectives.ops import broadcast as broadcast
    from ringtrain.collectives.ops import broadcast_ as broadcast_
    from ringtrain.collectives.ops import broadcast_async as broadcast_async
    from ringtrain.collectives.ops import broadcast_async_ as broadcast_async_
    from ringtrain.collectives.ops import grouped_allgather as grouped_allgather
    from ringtrain.collectives.ops import grouped_allgather_async as grouped_allgather_async
    from ringtrain.collectives.ops import grouped_allreduce as grouped_allreduce
    from ringtrain.collectives.ops import grouped_allreduce_ as grouped_allreduce_
    from ringtrain.collectives.ops import grouped_allreduce_async as grouped_allreduce_async
    from ringtrain.collectives.ops import grouped_allreduce_async_ as grouped_allreduce_async_
    from ringtrain.collectives.ops import grouped_reducescatter as grouped_reducescatter
    from ringtrain.collectives.ops import grouped_reducescatter_async as grouped_reducescatter_async
    from ringtrain.collectives.ops import poll as poll
    from ringtrain.collectives.ops import reducescatter as reducescatter
    from ringtrain.collectives.ops import reducescatter_async as reducescatter_async
    from ringtrain.collectives.ops import synchronize as synchronize
    from ringtrain.collectives.reduce_ops import Adasum as Adasum
    from ringtrain.collectives.reduce_ops import Average as Average
    from ringtrain.collectives.reduce_ops import Max as Max
    from ringtrain.collectives.reduce_ops import Min as Min
    from ringtrain.collectives.reduce_ops import Product as Product
    from ringtrain.collectives.reduce_ops import ReduceOp as ReduceOp
    from ringtrain.collectives.reduce_ops import Sum as Sum
    from ringtrain.collectives.step_timing import straggler_report as straggler_report
    from ringtrain.compression import Compression as Compression
    from ringtrain.config import Config as Config
    from ringtrain.engine.optimizer import DistributedOptimizer as DistributedOptimizer
    from ringtrain.engine.state_sync import broadcast_optimizer_state as broadcast_optimizer_state
    from ringtrain.engine.state_sync import broadcast_parameters as broadcast_parameters
    from ringtrain.engine.state_sync import join as join
    from ringtrain.engine.sync_batch_norm import SyncBatchNorm as SyncBatchNorm
    from ringtrain.errors import CollectiveArgumentError as CollectiveArgumentError
    from ringtrain.errors import CollectiveError as CollectiveError
    from ringtrain.errors import CollectiveMismatchError as CollectiveMismatchError
    from ringtrain.errors import ConfigError as ConfigError
    from ringtrain.errors import JobFailedError as JobFailedError
    from ringtrain.errors import JobPreemptedError as JobPreemptedError
    from ringtrain.errors import PeerFailedError as PeerFailedError
    from ringtrain.errors import RingtrainError as RingtrainError
    from ringtrain.errors import StallError as StallError
    from ringtrain.launch.python_run import run as run
    from ringtrain.lifecycle import add_process_set as add_process_set
    from ringtrain.lifecycle import init as init
    from ringtrain.lifecycle import remove_process_set as remove_process_set
    from ringtrain.lifecycle import shutdown as shutdown
    from ringtrain.lifecycle import start_timeline as start_timeline
    from ringtrain.lifecycle import stop_timeline as stop_timeline
    from ringtrain.runtime.process_sets import ProcessSet as ProcessSet
    from ringtrain.runtime.queries import cross_rank as cross_rank
    from ringtrain.runtime.queries import cross_size as cross_size
    from ringtrain.runtime.queries import is_homogeneous as is_homogeneous
    from ringtrain.runtime.queries import is_initialized as is_initialized
    from ringtrain.runtime.queries import local_rank as local_rank
    from ringtrain.runtime.queries import local_size as local_size
    from ringtrain.runtime.queries import rank as rank
    from ringtrain.runtime.queries import size as size
    from ringtrain.runtime.state import global_process_set as global_process_set
