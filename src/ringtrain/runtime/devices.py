"""Which path a process set's CUDA tensors take: NCCL, or host memory over the set's Gloo group.

NCCL runs one rank per GPU: a communicator with two ranks on one device fails ("Duplicate GPU
detected", ``ncclInvalidUsage``), and NCCL releases before 2.5 could hang instead. Several ranks
on one GPU are still a real use: ``ringtrain run -np 2`` on a one-GPU workstation, to try a
script before the cluster. So before a set's first CUDA collective its ranks exchange the
identity of the device that collective's tensors are on (:func:`identity`: host and PCI address,
what NCCL itself compares), and :func:`choose_route` decides. Ranks sharing a device send the
set's CUDA tensors through its Gloo group instead, which copies them to pinned host memory, runs
its CPU algorithm and copies the result back: the path every CUDA tensor of a sealed or TCP job
takes (see :mod:`ringtrain.runtime.communicator`).

The decision waits for the first CUDA collective, not ``init``: Horovod scripts call
``torch.cuda.set_device(hvd.local_rank())`` *after* ``hvd.init()``, so at ``init`` every rank of
a host still sees device 0, and the tensor's device is the one NCCL uses, whether or not the
rank called ``set_device``. Jobs without CUDA tensors never exchange anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringtrain import environ
from ringtrain.environ import Torch

# A rank's device: (host, an id unique on that host).
Device = tuple[str, str]


@dataclass(frozen=True)
class CudaRoute:
    """Where a set's CUDA tensors travel. ``reason``: why not NCCL, with what to do (empty when
    NCCL is used)."""

    nccl: bool
    reason: str = ""


def identity(device: torch.device, host: str) -> Device:
    """``device``'s identity as NCCL compares it (host, PCI address), with fallbacks for torch
    builds whose device properties lack the PCI fields."""
    props = torch.cuda.get_device_properties(device)
    domain, bus, dev = (
        getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")
    )
    if isinstance(domain, int) and isinstance(bus, int) and isinstance(dev, int):
        return host, f"PCI {domain:04x}:{bus:02x}:{dev:02x}"
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return host, f"GPU-{uuid}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = environ.current().get(Torch.CUDA_VISIBLE_DEVICES, "<all>")
    return host, f"cuda:{index} of CUDA_VISIBLE_DEVICES={visible}"


def choose_route(devices: Sequence[Device], ranks: Sequence[int], set_id: int = 0) -> CudaRoute:
    """NCCL unless two ranks of the set share a device. ``devices[i]``: the device of the set's
    ``i``-th rank, whose global rank is ``ranks[i]``. Pure: every rank decides alike."""
    by_device: dict[Device, list[int]] = {}
    for rank, device in zip(ranks, devices):
        by_device.setdefault((device[0], device[1]), []).append(rank)
    shared = [(device, rs) for device, rs in by_device.items() if len(rs) > 1]
    if not shared:
        return CudaRoute(True)
    where = "; ".join(
        f"ranks {_and(rs)} share {device} on host {host}" for (host, device), rs in shared[:3]
    )
    if len(shared) > 3:
        where += f"; and {len(shared) - 3} more devices are shared"
    return CudaRoute(
        False,
        f"{where}. NCCL runs one rank per GPU, so CUDA tensors of process set {set_id} travel "
        "through host memory over Gloo instead (each collective copies them to the CPU and "
        "back: correct, but far slower than NCCL).\n"
        "HINT: give every rank its own GPU: torch.cuda.set_device(hvd.local_rank()) after "
        "hvd.init(), or one CUDA_VISIBLE_DEVICES per rank. Sharing a GPU is fine for trying a "
        "script out.",
    )


def _and(ranks: Sequence[int]) -> str:
    names = [str(r) for r in ranks]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
