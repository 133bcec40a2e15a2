"""Horovod's module paths: ``from horovod.torch.X import Y`` works as ``ringtrain.torch.X``.

The table lists, per ``horovod.torch`` module a script imports from, the names Horovod defines
there (horovod/torch/*.py, its API docs and examples). Each must import from the ringtrain path
and be the very object ``hvd.<name>`` (``hvd.elastic.<name>`` under ``elastic``) is: the paths
re-export, they never hold a second implementation.
"""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ringtrain.torch as hvd

HOROVOD_PATHS: dict[str, list[str]] = {
    "horovod.torch.mpi_ops": [
        "init",
        "shutdown",
        "is_initialized",
        "start_timeline",
        "stop_timeline",
        "size",
        "local_size",
        "cross_size",
        "rank",
        "local_rank",
        "cross_rank",
        "is_homogeneous",
        "mpi_threads_supported",
        "mpi_enabled",
        "mpi_built",
        "gloo_enabled",
        "gloo_built",
        "nccl_built",
        "ddl_built",
        "ccl_built",
        "cuda_built",
        "rocm_built",
        "Average",
        "Sum",
        "Adasum",
        "Min",
        "Max",
        "Product",
        "ProcessSet",
        "global_process_set",
        "add_process_set",
        "remove_process_set",
        "HorovodInternalError",
        "Compression",
        "allreduce",
        "allreduce_async",
        "allreduce_",
        "allreduce_async_",
        "grouped_allreduce",
        "grouped_allreduce_async",
        "grouped_allreduce_",
        "grouped_allreduce_async_",
        "sparse_allreduce_async",
        "allgather",
        "allgather_async",
        "grouped_allgather",
        "grouped_allgather_async",
        "broadcast",
        "broadcast_async",
        "broadcast_",
        "broadcast_async_",
        "alltoall",
        "alltoall_async",
        "reducescatter",
        "reducescatter_async",
        "grouped_reducescatter",
        "grouped_reducescatter_async",
        "poll",
        "synchronize",
        "join",
        "barrier",
    ],
    "horovod.torch.functions": [
        "broadcast_parameters",
        "broadcast_optimizer_state",
        "broadcast_object",
        "allgather_object",
    ],
    "horovod.torch.optimizer": ["DistributedOptimizer"],
    "horovod.torch.compression": [
        "Compression",
        "Compressor",
        "NoneCompressor",
        "FP16Compressor",
    ],
    "horovod.torch.sync_batch_norm": ["SyncBatchNorm"],
    "horovod.torch.elastic": ["run", "TorchState", "ElasticSampler"],
    "horovod.torch.elastic.sampler": ["ElasticSampler"],
    "horovod.torch.elastic.state": [
        "TorchState",
        "ObjectState",
        "StateHandler",
        "ModelStateHandler",
        "OptimizerStateHandler",
        "SamplerStateHandler",
        "get_handler_registry",
        "set_handler_registry",
    ],
}
# Compressor and its subclasses, and the elastic state handlers, are not hvd attributes in
# Horovod either: they are checked against Compression's members and ringtrain.compression, and
# by tests/elastic/test_state_handlers.py.
HANDLERS = {"StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler"}
NOT_ON_HVD = {"Compressor", "NoneCompressor", "FP16Compressor"} | HANDLERS
NOT_ON_HVD |= {"get_handler_registry", "set_handler_registry"}


def _ours(path: str) -> str:
    return "ringtrain" + path.removeprefix("horovod")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", list(HOROVOD_PATHS))
def test_horovod_path_names_are_hvds_objects(path: str) -> None:
    module = importlib.import_module(_ours(path))
    home = hvd.elastic if path.startswith("horovod.torch.elastic") else hvd
    missing = [n for n in HOROVOD_PATHS[path] if not hasattr(module, n)]
    assert not missing, f"{_ours(path)} lacks {missing}"
    for name in HOROVOD_PATHS[path]:
        if name in NOT_ON_HVD:
            continue
        assert getattr(module, name) is getattr(home, name), f"{_ours(path)}.{name}"


@pytest.mark.timeout(60)
def test_compressor_classes_are_ringtrains() -> None:
    from ringtrain import compression
    from ringtrain.torch.compression import Compressor, FP16Compressor, NoneCompressor

    assert hvd.Compression.none is NoneCompressor and hvd.Compression.fp16 is FP16Compressor
    assert Compressor is compression.Compressor


@pytest.mark.timeout(60)
def test_hvd_elastic_is_the_package_under_horovods_path() -> None:
    """``hvd.elastic`` is ``ringtrain.torch.elastic`` whatever was imported first (binding
    another module there would be replaced by the submodule on its first import)."""
    import ringtrain.elastic
    import ringtrain.torch.elastic

    assert hvd.elastic is ringtrain.torch.elastic
    for name in ringtrain.elastic.__all__:
        assert getattr(hvd.elastic, name) is getattr(ringtrain.elastic, name), name


@pytest.mark.timeout(120)
def test_a_deep_path_imports_first_in_a_fresh_process() -> None:
    """A script whose first import is a deep path (Horovod's Ray elastic example) loads."""
    code = (
        "from ringtrain.torch.elastic.sampler import ElasticSampler\n"
        "import ringtrain.torch as hvd\n"
        "assert ElasticSampler is hvd.elastic.ElasticSampler\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=110)
