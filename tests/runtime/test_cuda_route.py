"""Where a set's CUDA tensors travel: NCCL unless two of its ranks share a GPU (pure decision),
the cpu group always under --secure or --transport tcp, and nothing of it on a CPU-only job."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

import ringtrain as rt
from ringtrain.runtime import devices
from ringtrain.runtime.devices import choose_route
from ringtrain.security import keys
from ringtrain.testing.spawn import World

GPU0, GPU1 = "PCI 0000:3b:00", "PCI 0000:5e:00"


def test_a_gpu_per_rank_uses_nccl() -> None:
    assert choose_route([("a", GPU0), ("a", GPU1)], [0, 1]).nccl
    # the same PCI address on two hosts is two GPUs
    route = choose_route([("a", GPU0), ("b", GPU0), ("a", GPU1), ("b", GPU1)], [0, 1, 2, 3])
    assert route.nccl and route.reason == ""
    assert choose_route([("a", GPU0)], [5]).nccl


def test_ranks_sharing_a_gpu_go_through_host_memory() -> None:
    route = choose_route([("a", GPU0), ("a", GPU0)], [0, 1])
    assert not route.nccl
    assert route.reason.startswith(f"ranks 0 and 1 share {GPU0} on host a. NCCL runs one rank")
    assert "CUDA tensors of process set 0 travel through host memory over Gloo" in route.reason
    assert "HINT: give every rank its own GPU: torch.cuda.set_device(hvd.local_rank())" in (
        route.reason
    )


def test_the_message_names_global_ranks_set_and_every_shared_gpu() -> None:
    # a process set of global ranks 1, 3, 4, 6: 1 and 4 share a GPU; 3 and 6 have their own
    route = choose_route([("a", GPU0), ("a", GPU1), ("a", GPU0), ("b", GPU1)], [1, 3, 4, 6], 2)
    assert not route.nccl
    assert route.reason.startswith(f"ranks 1 and 4 share {GPU0} on host a. ")
    assert "process set 2" in route.reason
    three = choose_route([("a", GPU0)] * 3 + [("b", GPU0)] * 2, range(5))
    assert three.reason.startswith(
        f"ranks 0, 1 and 2 share {GPU0} on host a; ranks 3 and 4 share {GPU0} on host b. "
    )
    many = choose_route([(h, GPU0) for h in "abcde" for _ in range(2)], range(10))
    assert "ranks 4 and 5 share" in many.reason and "ranks 6 and 7" not in many.reason
    assert "; and 2 more devices are shared." in many.reason


def _cpu_only() -> tuple[object, bool]:
    comm = rt.global_process_set.communicator
    rt.allreduce(torch.ones(2))
    return comm.cuda_route, comm.optional_group("nccl") is None


def test_cpu_tensors_decide_nothing(world2: World) -> None:
    # No exchange for CPU tensors; without CUDA no NCCL group is made either.
    for route, no_nccl in world2.run(_cpu_only):
        assert route is None
        assert no_nccl == (not torch.cuda.is_available())


def _decide(shared: bool) -> tuple[devices.CudaRoute | None, str, list[str]]:
    """The communicator's decision at its first CUDA collective, on CPU-only ranks: a stand-in
    for the NCCL group, and device identities as two ranks sharing (or not sharing) a GPU."""
    comm = rt.global_process_set.communicator
    nccl, real = object(), comm._groups.get("nccl")
    comm._groups["nccl"] = nccl
    saved = devices.identity
    devices.identity = lambda device, host: (host, "GPU0" if shared else f"GPU{rt.rank()}")
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    keep = Keep()
    logging.getLogger("ringtrain").addHandler(keep)
    try:
        comm._route_cuda(torch.device("cpu"))
        comm._route_cuda(torch.device("cpu"))  # decided once: no second exchange
        group = comm.group("cuda")
        which = "nccl" if group is nccl else "cpu" if group is comm.group("cpu") else "?"
        rt.allreduce(torch.ones(1))  # the cpu group still works after the exchange on it
        return comm.cuda_route, which, warnings
    finally:
        logging.getLogger("ringtrain").removeHandler(keep)
        devices.identity = saved
        del comm._groups["nccl"], comm._groups["cuda"]
        comm.cuda_route = None
        if real is not None:
            comm._groups["nccl"] = real


def test_the_first_cuda_collective_decides_for_the_set(world2: World) -> None:
    for rank, (route, which, warnings) in enumerate(world2.run(_decide, True)):
        assert route is not None and not route.nccl and which == "cpu"
        assert route.reason.startswith("ranks 0 and 1 share GPU0 on host ")
        assert warnings == ([route.reason] if rank == 0 else []), "one warning, from rank 0"
    for route, which, warnings in world2.run(_decide, False):
        assert route == devices.CudaRoute(True) and which == "nccl" and warnings == []


def test_sealed_and_tcp_groups_carry_cuda_tensors_on_the_cpu_group(
    world2: World, tmp_path: Path
) -> None:
    # NCCL cannot seal and is not ringtrain's TCP mesh: under --secure or --transport tcp the
    # set's CUDA tensors take its cpu group from the start, even when every rank has its own
    # GPU, so no route is decided.
    key_file = keys.write_key_file(tmp_path / "job.key", keys.generate_job_key())
    for settings in ({"secure": True, "key_file": key_file}, {"transport": "tcp"}):
        for route, which, warnings in world2.run(_decide, False, **settings):
            assert (route, which, warnings) == (None, "cpu", []), settings
