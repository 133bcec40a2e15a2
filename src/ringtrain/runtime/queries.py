"""Who am I: rank and size queries, as in Horovod. All raise before ``init()``."""

from __future__ import annotations

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


def nccl_built() -> bool:
    import torch.distributed as dist

    return bool(dist.is_nccl_available())


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
