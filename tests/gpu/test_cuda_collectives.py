"""CUDA tensors through every collective, autograd, DistributedOptimizer and SyncBatchNorm.

Skipped where CUDA is not available (CI has no GPU): run ``pytest tests/gpu`` on a GPU machine.
Each rank uses the GPU a Horovod script would give it, ``local_rank % device_count``: with one
GPU every rank is on ``cuda:0``, so at two ranks they share it, NCCL is not used, and the set's
CUDA tensors travel through host memory over Gloo (see :mod:`ringtrain.runtime.devices`); with
a GPU per rank they travel on NCCL. Expected values are written arithmetically, as the CPU tests
write them, and every result must come back on the input's device with the input's dtype. Each
op runs once small (at most 4 KiB; CUDA tensors never travel inside the negotiation round, so
this is the small-message collective) and once large (MiB).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _cuda import rank_gpu

import ringtrain as rt
import ringtrain.torch as hvd
from ringtrain.testing import spawn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: torch.cuda.is_available() is False",
)

SIZES = pytest.mark.parametrize("numel", [16, 1 << 20], ids=["small", "large"])
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)


@pytest.fixture(params=[1, 2], ids=lambda n: f"np{n}")
def gpu_world(request: pytest.FixtureRequest) -> spawn.World:
    return spawn.world(request.param)


def _check(got: torch.Tensor, expected: torch.Tensor, dev: torch.device, what: str) -> None:
    """``got`` is on ``dev``, in ``expected``'s dtype, and equal to it (exact for integers)."""
    assert got.device == dev, f"{what}: on {got.device}, expected {dev}"
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
    torch.testing.assert_close(got.cpu(), expected, msg=lambda m: f"{what}: {m}")


# ---- allreduce -------------------------------------------------------------------------------


def _allreduce_ops(numel: int) -> None:
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    ranks_sum = n * (n - 1) // 2
    for dtype in DTYPES:
        # Small integers: exact in every dtype here, halves included (fp16 Average divides first).
        base = (torch.arange(numel) % 7).to(torch.float64)
        x = (base + r).to(dtype).to(dev)
        what = f"{dtype} x{numel}"
        _check(hvd.allreduce(x, op=hvd.Sum), (base * n + ranks_sum).to(dtype), dev, f"Sum {what}")
        average = (
            torch.div(base * n + ranks_sum, n, rounding_mode="floor")  # integers floor, as Horovod
            if dtype == torch.int64
            else base + ranks_sum / n
        )
        _check(hvd.allreduce(x), average.to(dtype), dev, f"Average {what}")
        _check(hvd.allreduce(x, op=hvd.Min), base.to(dtype), dev, f"Min {what}")
        _check(hvd.allreduce(x, op=hvd.Max), (base + n - 1).to(dtype), dev, f"Max {what}")
        p = torch.full((numel,), r + 2, dtype=dtype, device=dev)
        product = torch.full((numel,), math.prod(range(2, n + 2)), dtype=dtype)
        _check(hvd.allreduce(p, op=hvd.Product), product, dev, f"Product {what}")
        scaled = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
        _check(scaled, (base * n + ranks_sum).to(dtype), dev, f"Sum pre 2 post 0.5 {what}")
        assert torch.equal(x.cpu(), (base + r).to(dtype)), f"allreduce changed its input ({what})"


@SIZES
def test_allreduce_ops_and_dtypes(gpu_world: spawn.World, numel: int) -> None:
    gpu_world.run(_allreduce_ops, numel, timeout=90)


def _allreduce_variants(numel: int) -> None:
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    total = n * (n + 1) / 2
    h = hvd.allreduce_async(torch.full((numel,), r + 1.0, device=dev), op=hvd.Sum, name="a.async")
    _check(hvd.synchronize(h), torch.full((numel,), total), dev, "allreduce_async")
    t = torch.full((numel,), r + 1.0, device=dev)
    assert hvd.allreduce_(t, op=hvd.Sum) is t
    _check(t, torch.full((numel,), total), dev, "allreduce_")
    t2 = torch.full((numel,), r + 1.0, device=dev)
    assert hvd.synchronize(hvd.allreduce_async_(t2, op=hvd.Sum, name="a.async_")) is t2
    _check(t2, torch.full((numel,), total), dev, "allreduce_async_")
    # a column of a matrix: not contiguous, reduced in place all the same
    m = torch.full((numel, 2), r + 1.0, device=dev)
    hvd.allreduce_(m[:, 1], op=hvd.Sum)
    _check(m[:, 1], torch.full((numel,), total), dev, "allreduce_ of a column")
    _check(m[:, 0], torch.full((numel,), r + 1.0), dev, "allreduce_ beside a column")
    outs = hvd.grouped_allreduce(
        [torch.full((numel,), r + 1.0, device=dev), torch.ones(3, 2, device=dev)], op=hvd.Sum
    )
    _check(outs[0], torch.full((numel,), total), dev, "grouped_allreduce [0]")
    _check(outs[1], torch.full((3, 2), float(n)), dev, "grouped_allreduce [1]")
    group = [torch.ones(numel, device=dev), torch.full((5,), 2.0, device=dev)]
    hvd.grouped_allreduce_(group, op=hvd.Sum)
    _check(group[0], torch.full((numel,), float(n)), dev, "grouped_allreduce_ [0]")
    _check(group[1], torch.full((5,), 2.0 * n), dev, "grouped_allreduce_ [1]")
    y = hvd.allreduce(torch.full((numel,), 0.5, device=dev), compression=hvd.Compression.fp16)
    _check(y, torch.full((numel,), 0.5), dev, "allreduce with fp16 compression")


@SIZES
def test_allreduce_variants(gpu_world: spawn.World, numel: int) -> None:
    gpu_world.run(_allreduce_variants, numel)


# ---- data movement ---------------------------------------------------------------------------


def _movement(width: int) -> None:
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    # allgather: rank k sends k+1 rows
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        got = hvd.allgather(torch.full((r + 1, width), r, dtype=dtype, device=dev))
        want = torch.cat([torch.full((k + 1, width), k, dtype=dtype) for k in range(n)])
        _check(got, want, dev, f"allgather {dtype}")
    outs = hvd.grouped_allgather(
        [torch.full((r + 1,), float(r), device=dev), torch.ones(1, 2).to(dev)]
    )
    _check(
        outs[0],
        torch.cat([torch.full((k + 1,), float(k)) for k in range(n)]),
        dev,
        "grouped_allgather",
    )
    _check(outs[1], torch.ones(n, 2), dev, "grouped_allgather [1]")

    # broadcast from the first and the last rank, out of place and in place
    for root in sorted({0, n - 1}):
        t = torch.full((width, 3), float(r), device=dev)
        _check(
            hvd.broadcast(t, root), torch.full((width, 3), float(root)), dev, f"broadcast {root}"
        )
        _check(t, torch.full((width, 3), float(r)), dev, "broadcast's input (out of place)")
        assert hvd.broadcast_(t, root) is t
        _check(t, torch.full((width, 3), float(root)), dev, f"broadcast_ from {root}")
        h = hvd.broadcast_async_(torch.full((width,), r, device=dev), root, name=f"b.{root}")
        _check(hvd.synchronize(h), torch.full((width,), root), dev, f"broadcast_async_ {root}")

    # alltoall with splits: rank r sends k+1 rows to rank k, each row tagged (sender, receiver)
    splits = [k + 1 for k in range(n)]
    rows = torch.cat(
        [torch.tensor([[r, k]], dtype=torch.int32).repeat(k + 1, width) for k in range(n)]
    ).to(dev)
    out, received = hvd.alltoall(rows, splits=splits)
    assert received.tolist() == [r + 1] * n
    want = torch.cat(
        [torch.tensor([[s, r]], dtype=torch.int32).repeat(r + 1, width) for s in range(n)]
    )
    _check(out, want, dev, "alltoall with splits")
    even = hvd.alltoall((torch.arange(n) + 10 * r).to(dev))
    _check(even, torch.tensor([10 * s + r for s in range(n)]), dev, "alltoall without splits")

    # reducescatter: uneven rows, the first rank gets one more
    total = 2 * n + 1
    counts = [total // n + (1 if k < total % n else 0) for k in range(n)]
    start = sum(counts[:r])
    full = torch.arange(total * width, dtype=torch.float32).reshape(total, width)
    got = hvd.reducescatter((full * (r + 1)).to(dev), op=hvd.Sum)
    _check(got, full[start : start + counts[r]] * (n * (n + 1) // 2), dev, "reducescatter Sum")
    got = hvd.reducescatter(torch.ones(n * 2, width, device=dev))
    _check(got, torch.ones(2, width), dev, "reducescatter Average")


@pytest.mark.parametrize("width", [4, 1 << 18], ids=["small", "large"])
def test_allgather_broadcast_alltoall_reducescatter(gpu_world: spawn.World, width: int) -> None:
    gpu_world.run(_movement, width, timeout=90)


def _objects(numel: int) -> None:
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    obj = {"step": 7, "weights": torch.full((numel,), 3.0, device=dev)} if r == 0 else None
    got = hvd.broadcast_object(obj, root_rank=0)
    assert got["step"] == 7
    # pickled CUDA tensors come back on the root's device index (cuda:0 here)
    _check(got["weights"], torch.full((numel,), 3.0), torch.device("cuda", 0), "broadcast_object")
    every = hvd.allgather_object(("rank", r, torch.full((numel,), float(r), device=dev)))
    assert [e[:2] for e in every] == [("rank", k) for k in range(n)]
    for k, e in enumerate(every):
        assert e[2].is_cuda and torch.equal(e[2].cpu(), torch.full((numel,), float(k)))


@SIZES
def test_objects_holding_cuda_tensors(gpu_world: spawn.World, numel: int) -> None:
    gpu_world.run(_objects, numel)


# ---- autograd, optimizer, SyncBatchNorm ------------------------------------------------------


def _autograd() -> None:
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    # As Horovod: the gradient of an allreduce is the allreduce (same op) of the gradients.
    x = torch.full((2, 3), r + 1.0, device=dev, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum)
    _check(y.detach(), torch.full((2, 3), n * (n + 1) / 2), dev, "allreduce forward")
    (y * (r + 1)).sum().backward()
    _check(x.grad, torch.full((2, 3), n * (n + 1) / 2), dev, "allreduce Sum gradient")
    x = torch.ones(4, device=dev, requires_grad=True)
    (hvd.allreduce(x) * (r + 1)).sum().backward()  # Average
    _check(x.grad, torch.full((4,), (n + 1) / 2), dev, "allreduce Average gradient")
    x = torch.ones(r + 1, 2, device=dev, requires_grad=True)
    hvd.allgather(x).sum().backward()
    _check(x.grad, torch.ones(r + 1, 2), dev, "allgather gradient")


def test_autograd(gpu_world: spawn.World) -> None:
    gpu_world.run(_autograd)


STEPS = 5
PER_RANK = 8


def _model(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    return model.to(dev, torch.float64)


def _batch(step: int, n: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(PER_RANK * n, 10, generator=g, dtype=torch.float64)
    return x.to(dev), torch.randint(0, 3, (PER_RANK * n,), generator=g).to(dev)


def _train(compression: str) -> list[torch.Tensor]:
    """Train on this rank's slice of each global batch; check against one process training on
    the whole global batch on the same GPU (float tolerance: the kernels differ). In float64,
    which no TF32 setting touches."""
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    model = _model(dev)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, compression),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        x, y = _batch(step, n, dev)
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        opt.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    ref = _model(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, n, dev)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()  # the mean over the global batch
        ref_opt.step()
    tol = {"none": (1e-7, 1e-9), "fp16": (1e-2, 1e-3)}[compression]
    for (name, p), want in zip(model.named_parameters(), ref.parameters()):
        assert p.device == dev and torch.isfinite(p).all(), name
        torch.testing.assert_close(
            p, want, rtol=tol[0], atol=tol[1], msg=lambda m, name=name: f"{name}: {m}"
        )
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_distributed_optimizer(gpu_world: spawn.World, compression: str) -> None:
    first, *others = gpu_world.run(_train, compression, timeout=90)
    for weights in others:  # every rank holds the same weights, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(first, weights))


def _sync_batch_norm() -> None:
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5)).to(dev)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), hvd.SyncBatchNorm(5)).to(dev)
    model.load_state_dict(ref.state_dict())
    sizes = [k + 2 for k in range(n)]  # uneven slices
    total, start = sum(sizes), sum(sizes[:r])
    mine = slice(start, start + sizes[r])
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(total, 6, generator=g) * 3 + 2).to(dev)
    out_ref = ref(x)
    out = model(x[mine])
    assert out.device == dev
    torch.testing.assert_close(out, out_ref[mine], rtol=1e-4, atol=1e-5)
    out_ref.square().mean().backward()
    (out.square().mean() * sizes[r] / total).backward()
    for p, p_ref in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and p_ref.grad is not None
        grad = hvd.allreduce(p.grad, op=hvd.Sum)
        torch.testing.assert_close(grad, p_ref.grad, rtol=1e-4, atol=1e-5)
    for name, buf in model[1].named_buffers():
        torch.testing.assert_close(buf, ref[1].get_buffer(name), rtol=1e-4, atol=1e-5)


def test_sync_batch_norm(gpu_world: spawn.World) -> None:
    gpu_world.run(_sync_batch_norm)


# ---- which path CUDA tensors take --------------------------------------------------------------


def _route(own_gpus: bool) -> tuple[bool, str, list[str]]:
    dev = rank_gpu() if own_gpus else torch.device("cuda", 0)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    keep = Keep()
    logging.getLogger("ringtrain").addHandler(keep)
    try:
        x = torch.ones(4, device=dev)
        _check(hvd.allreduce(x, op=hvd.Sum), torch.full((4,), float(hvd.size())), dev, "route")
    finally:
        logging.getLogger("ringtrain").removeHandler(keep)
    route = rt.global_process_set.communicator.cuda_route
    assert route is not None, "the first CUDA collective did not decide the route"
    return route.nccl, route.reason, warnings


def test_ranks_sharing_a_gpu_go_through_host_memory(gpu_world: spawn.World) -> None:
    results = gpu_world.run(_route, False)
    if gpu_world.size == 1:
        assert results == [(True, "", [])]
        return
    for rank, (nccl, reason, warnings) in enumerate(results):
        assert not nccl
        assert "ranks 0 and 1 share" in reason and "HINT: give every rank its own GPU" in reason
        assert warnings == ([reason] if rank == 0 else []), "one warning, from the first rank"


def test_ranks_with_their_own_gpus_use_nccl(gpu_world: spawn.World) -> None:
    if torch.cuda.device_count() < gpu_world.size:
        pytest.skip(f"needs {gpu_world.size} GPUs, this machine has {torch.cuda.device_count()}")
    for nccl, reason, warnings in gpu_world.run(_route, True):
        assert nccl and reason == "" and warnings == []


def _process_set_route() -> tuple[bool, str] | None:
    dev, r = rank_gpu(), hvd.rank()
    # Ranks 0 and 1 of 3: add_process_set refuses the whole world's ranks, as Horovod's does.
    ps = rt.add_process_set([0, 1])
    try:
        if not ps.included():
            return None
        t = torch.full((8,), float(r), device=dev)
        _check(hvd.broadcast(t, 1, process_set=ps), torch.full((8,), 1.0), dev, "set")
        route = ps.communicator.cuda_route
        assert route is not None
        return route.nccl, route.reason
    finally:
        hvd.barrier()
        assert rt.remove_process_set(ps)


def test_each_process_set_decides_for_itself(world3: spawn.World) -> None:
    shared = torch.cuda.device_count() < 2  # ranks 0 and 1 use GPUs 0 and 1 where there are two
    for got in world3.run(_process_set_route)[:2]:
        assert got is not None
        nccl, reason = got
        assert nccl == (not shared)
        assert ("CUDA tensors of process set 1 travel through host memory" in reason) == shared


# ---- the engine's schedules, and secure mode, on CUDA tensors ---------------------------------


def _train_mode(overlap: bool, shard: bool, whole: bool = False) -> list[torch.Tensor]:
    """Adam (torch's CUDA kernels; fused on the shards) with or without cross-iteration overlap
    and the sharded step, several buckets; every parameter read after synchronize(). ``whole``:
    a step hook makes the engine step the optimizer whole instead of bucket by bucket."""
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    model = _model(dev)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    if whole:
        inner.register_step_post_hook(lambda *_: None)
    opt = hvd.DistributedOptimizer(
        inner,
        named_parameters=model.named_parameters(),
        overlap=overlap,
        shard_optimizer=shard,
        fusion_threshold_bytes=2048,
        link_class="slow",
    )
    for step in range(STEPS):
        x, y = _batch(step, n, dev)
        mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
        opt.zero_grad()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    opt.synchronize()
    assert opt.overlap == (overlap and n > 1) and opt.shards_state == (shard and n > 1)
    for p in model.parameters():
        assert p.device == dev
    return [p.detach().cpu() for p in model.parameters()]


def _schedules() -> dict[str, list[torch.Tensor]]:
    runs = {
        f"overlap={o} shard={s}": _train_mode(o, s) for o in (False, True) for s in (False, True)
    }
    runs["whole"] = _train_mode(False, False, whole=True)
    return runs


def test_overlap_and_the_sharded_step_on_cuda(gpu_world: spawn.World) -> None:
    """Overlap gives the same bits as the same step without it (plain, and sharded), and the
    default step (bucket by bucket) the same bits as the whole optimizer's step; the sharded
    step gives float-tolerance equal weights (a different reduction: reduce-scatter)."""
    results = gpu_world.run(_schedules, timeout=120)
    for got in results:
        assert all(
            torch.equal(a, b) for a, b in zip(got["whole"], got["overlap=False shard=False"])
        )
        for shard in (False, True):
            plain, overlapped = (
                got[f"overlap=False shard={shard}"],
                got[f"overlap=True shard={shard}"],
            )
            assert all(torch.equal(a, b) for a, b in zip(plain, overlapped)), f"shard={shard}"
        for a, b in zip(got["overlap=False shard=False"], got["overlap=False shard=True"]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    for other in results[1:]:
        for mode, weights in other.items():
            assert all(torch.equal(a, b) for a, b in zip(results[0][mode], weights)), mode


def _sealed_cuda() -> list[torch.Tensor]:
    dev, r, n = rank_gpu(), hvd.rank(), hvd.size()
    x = torch.arange(1 << 16, dtype=torch.float32, device=dev) + r
    out = [hvd.allreduce(x, op=hvd.Sum), hvd.broadcast(x, n - 1), hvd.allgather(x[:5])]
    for t in out:
        assert t.device == dev
    _check(out[0], torch.arange(1 << 16, dtype=torch.float32) * n + n * (n - 1) // 2, dev, "sum")
    _check(out[1], torch.arange(1 << 16, dtype=torch.float32) + n - 1, dev, "broadcast")
    return [*(t.cpu() for t in out), *_train("none")]


def test_secure_mode_moves_cuda_tensors(gpu_world: spawn.World, tmp_path: Any) -> None:
    """Sealed collectives and the optimizer on CUDA tensors give the plain run's results."""
    from ringtrain.security import keys

    key = keys.write_key_file(tmp_path / "job.key", keys.generate_job_key())
    plain = gpu_world.run(_sealed_cuda, timeout=120)
    sealed = gpu_world.run(_sealed_cuda, timeout=120, secure=True, key_file=key)
    for p, s in zip(plain, sealed):
        assert all(torch.equal(a, b) for a, b in zip(p, s))
