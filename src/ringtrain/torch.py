"""Horovod's PyTorch API: ``import ringtrain.torch as hvd`` runs Horovod scripts unchanged.

Every name here is the ringtrain implementation of the Horovod name it carries; nothing is a stub.
Names Horovod has that ringtrain does not support (Adasum, MPI-specific queries) raise a clear
error or answer truthfully (``mpi_enabled() -> False``). ``HorovodInternalError`` is,
as in Horovod, the ``RuntimeError`` a failed collective raises (a mismatch across ranks, a
stall, a peer gone): the base of :class:`ringtrain.errors.CollectiveError`.
"""

from __future__ import annotations

from ringtrain import elastic
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
    sparse_allreduce_async,
    synchronize,
)
from ringtrain.collectives.reduce_ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ringtrain.compression import Compression
from ringtrain.engine.optimizer import DistributedOptimizer
from ringtrain.engine.state_sync import broadcast_optimizer_state, broadcast_parameters
from ringtrain.engine.sync_batch_norm import SyncBatchNorm
from ringtrain.errors import HorovodInternalError, HostsUpdatedInterrupt
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
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from ringtrain.runtime.state import global_process_set

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
