"""The public surface: what `import ringtrain` and `import ringtrain.torch as hvd` offer."""

from __future__ import annotations

import subprocess
import sys

import ringtrain
import ringtrain.torch as hvd

HOROVOD_NAMES = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "alltoall",
    "alltoall_async",
    "poll",
    "synchronize",
    "barrier",
    "join",
    "broadcast_object",
    "allgather_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "DistributedOptimizer",
    "SyncBatchNorm",
    "Compression",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
    "ProcessSet",
    "add_process_set",
    "remove_process_set",
    "global_process_set",
    "mpi_enabled",
    "gloo_enabled",
    "nccl_built",
    "cuda_built",
    "rocm_built",
    "ddl_built",
    "ccl_built",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
]


def test_horovod_names_all_exist() -> None:
    missing = [n for n in HOROVOD_NAMES if not hasattr(hvd, n)]
    assert not missing


def test_facade_exports_resolve() -> None:
    for name in ringtrain.__all__:
        assert getattr(ringtrain, name) is not None, name
    assert ringtrain.allreduce is hvd.allreduce
    assert ringtrain.DistributedOptimizer is hvd.DistributedOptimizer
    assert ringtrain.SyncBatchNorm is hvd.SyncBatchNorm


def test_compression_spellings() -> None:
    assert hvd.Compression.fp16.name == "fp16" and hvd.Compression.none.name == "none"


def test_import_has_no_side_effects_and_no_torch() -> None:
    code = (
        "import sys, ringtrain, ringtrain.config, ringtrain.errors; print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "False"


def test_calls_before_init_explain_what_to_do() -> None:
    import pytest
    import torch

    with pytest.raises(ringtrain.RingtrainError, match=r"ringtrain.init\(\)"):
        hvd.rank()
    with pytest.raises(ringtrain.RingtrainError, match=r"ringtrain.init\(\)"):
        hvd.allreduce(torch.ones(1))
