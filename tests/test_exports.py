"""The public surface: what `import ringtrain` and `import ringtrain.torch as hvd` offer."""

from __future__ import annotations

import ast
import importlib
import importlib.resources
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import ringtrain
import ringtrain.torch as hvd

PUBLIC_NAMES = Path(__file__).with_name("public_names.txt")
# ringtrain.torch's modules under Horovod's paths (tests/test_horovod_paths.py checks that their
# names are hvd's objects); their names are public too.
HOROVOD_PATHS = [
    "ringtrain.torch.elastic",
    "ringtrain.torch.elastic.sampler",
    "ringtrain.torch.elastic.state",
    "ringtrain.torch.compression",
    "ringtrain.torch.functions",
    "ringtrain.torch.mpi_ops",
    "ringtrain.torch.optimizer",
    "ringtrain.torch.sync_batch_norm",
]

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


def _public(module: ModuleType, prefix: str) -> set[str]:
    """The module's public names, as ``prefix.name``: its ``__all__``, and anything else it
    binds without a leading underscore (an import that leaks into the namespace counts too),
    except its own submodules and ``from __future__ import annotations``."""
    bound = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and n != "annotations"
        and not (isinstance(v, ModuleType) and v.__name__.startswith(module.__name__ + "."))
    }
    if module is ringtrain:
        bound -= {"TYPE_CHECKING", "Any", "importlib"}  # the lazy facade's own machinery
    return {f"{prefix}.{n}" for n in set(module.__all__) | bound}


def test_the_public_names_are_the_checked_in_list() -> None:
    listed = {
        line.strip()
        for line in PUBLIC_NAMES.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    current = _public(ringtrain, "ringtrain") | _public(hvd, "ringtrain.torch")
    for path in HOROVOD_PATHS:
        current |= _public(importlib.import_module(path), path)
    added, removed = sorted(current - listed), sorted(listed - current)
    assert not added and not removed, (
        f"the public surface changed: added {added}, removed {removed}.\n"
        f"HINT: if that was meant, change {PUBLIC_NAMES.name} in the same commit; if not, "
        "rename the helper with a leading underscore or restore the name."
    )


def test_the_facade_types_what_it_loads() -> None:
    """ringtrain/__init__.py's TYPE_CHECKING imports name exactly the lazily loaded exports."""
    tree = ast.parse(Path(ringtrain.__file__).read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    typed = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name  # "X as X": re-exported for type checkers
    }
    assert typed == ringtrain._EXPORTS


def test_the_package_ships_its_types() -> None:
    assert importlib.resources.files("ringtrain").joinpath("py.typed").is_file()


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


def test_horovods_spark_estimator_path_says_what_to_use_instead() -> None:
    import pytest

    with pytest.raises(ImportError, match="no Spark Estimator") as e:
        import ringtrain.spark.torch  # noqa: F401
    assert "ringtrain.spark.run" in str(e.value) and "TorchDistributor" in str(e.value)
