"""Who am I: rank and size queries, as in Horovod. All raise before ``init()``."""

from __future__ import annotations

from typing import Any

from ringtrain.runtime import state


def rank() -> int:
    """This process's rank in the world."""
    return state.current().rank


def size() -> int:
    """The number of ranks in the world."""
    return state.current().size


def local_rank() -> int:
    """This process's rank among the ranks on its host."""
    return state.current().local_rank


def local_size() -> int:
    """The number of ranks on this process's host."""
    return state.current().local_size


def cross_rank() -> int:
    """This host's index among the hosts that run a rank with this local rank."""
    return state.current().cross_rank


def cross_size() -> int:
    """The number of hosts that run a rank with this local rank."""
    return state.current().cross_size


def is_initialized() -> bool:
    return state.is_initialized()


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    return state.current().topology.is_homogeneous


def gloo_enabled() -> bool:
    return True


def gloo_built() -> bool:
    return True


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def nccl_built() -> int:
    """Horovod's ``NCCL_VERSION_CODE`` of the NCCL torch was built with (2.21.5: 22105), or 0
    without NCCL. An int, as Horovod's: scripts compare it (``nccl_built() < 2700``)."""
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return 0
    version = torch.cuda.nccl.version()  # (major, minor, patch); older torch: the code itself
    return version if isinstance(version, int) else nccl_version_code(version)


def nccl_version_code(version: tuple[Any, ...]) -> int:
    """nccl.h's ``NCCL_VERSION(X, Y, Z)``: ``X*1000 + Y*100 + Z`` up to 2.8, ``X*10000 + Y*100
    + Z`` from 2.9 (when minor versions passed 9)."""
    major, minor, patch = (int(v) for v in version[:3])  # newer torch may add a suffix
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def cuda_built() -> bool:
    """Whether CUDA tensors can be reduced: torch was built with CUDA (NCCL does the work)."""
    import torch

    return bool(torch.backends.cuda.is_built())  # type: ignore[no-untyped-call]


def rocm_built() -> bool:
    import torch

    return torch.version.hip is not None


def ddl_built() -> bool:
    return False  # IBM DDL is a Horovod/MPI backend; ringtrain runs on torch.distributed


def ccl_built() -> bool:
    return False  # oneCCL likewise


def mpi_threads_supported() -> bool:
    """Raises ``ValueError``, as Horovod's does where its MPI is not enabled: ringtrain's
    training traffic never goes over MPI (``mpi_enabled()`` is False)."""
    raise ValueError(
        "MPI is not enabled: ringtrain's collectives run on torch.distributed, never on MPI.\n"
        "HINT: mpi4py and other MPI libraries can run beside ringtrain's ranks; check "
        "hvd.mpi_enabled() before asking about MPI threads."
    )
