"""SyncBatchNorm against torch's BatchNorm on the whole global batch, run at sizes 1-3.

Each rank holds a slice of one global batch (slices of different sizes); outputs, input and
parameter gradients and running statistics must match a single-process model with plain
BatchNorm that sees the whole batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ringtrain as rt
import ringtrain.torch as hvd
from ringtrain.runtime.process_sets import ProcessSet
from ringtrain.testing.spawn import World

STEPS = 3
LR = 0.1


def _models(kind: str, momentum: float | None, track: bool) -> tuple[nn.Module, nn.Module]:
    """The same initial weights with SyncBatchNorm and with torch's BatchNorm."""
    torch.manual_seed(0)
    if kind == "conv":  # (N, C, H, W) into the norm
        ref = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4, momentum=momentum, track_running_stats=track),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * 5 * 5, 2),
        )
    else:  # (N, C) into the norm
        ref = nn.Sequential(
            nn.Linear(6, 5),
            nn.BatchNorm1d(5, momentum=momentum, track_running_stats=track),
            nn.Tanh(),
            nn.Linear(5, 2),
        )
    model = copy.deepcopy(ref)
    bn = ref[1]
    sync = hvd.SyncBatchNorm(bn.num_features, momentum=momentum, track_running_stats=track)
    sync.load_state_dict(bn.state_dict())
    model[1] = sync
    return model, ref


def _global_batch(kind: str, total: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (total, 3, 5, 5) if kind == "conv" else (total, 6)
    # An offset and scale so the statistics are far from the initial running stats (0, 1).
    return torch.randn(shape, generator=g) * 3 + 2, torch.randn(total, 2, generator=g)


def _equivalence(members: list[int] | None) -> None:
    ps = rt.add_process_set(members) if members is not None else None
    ranks = members if members is not None else list(range(rt.size()))
    if rt.rank() in ranks:
        me = ranks.index(rt.rank())
        sizes = [i + 2 for i in range(len(ranks))]  # uneven slices: 2, 3, 4 samples
        for kind, momentum, track in (
            ("conv", 0.1, True),
            ("linear", None, True),
            ("conv", 0.1, False),
        ):
            _train_and_compare(kind, momentum, track, sizes, me, ps)
    if ps is not None:
        rt.barrier()
        assert rt.remove_process_set(ps)


def _train_and_compare(
    kind: str,
    momentum: float | None,
    track: bool,
    sizes: list[int],
    me: int,
    ps: ProcessSet | None,
) -> None:
    model, ref = _models(kind, momentum, track)
    if ps is not None:
        model[1].process_set = ps
    total, start = sum(sizes), sum(sizes[:me])
    mine = slice(start, start + sizes[me])
    for step in range(STEPS):
        x, y = _global_batch(kind, total, step)
        x_ref = x.clone().requires_grad_()
        out_ref = ref(x_ref)
        nn.functional.mse_loss(out_ref, y).backward()

        x_mine = x[mine].clone().requires_grad_()
        out = model(x_mine)
        # Each slice's mean loss weighted by its share: the sum over ranks is the full-batch mean.
        (nn.functional.mse_loss(out, y[mine]) * sizes[me] / total).backward()

        torch.testing.assert_close(out, out_ref[mine])
        torch.testing.assert_close(x_mine.grad, x_ref.grad[mine])
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            grad = rt.allreduce(p.grad, op=rt.Sum, process_set=ps)
            torch.testing.assert_close(grad, p_ref.grad, msg=lambda m, n=name: f"{n}: {m}")
            with torch.no_grad():
                p -= LR * grad
                p_ref -= LR * p_ref.grad
            p.grad = p_ref.grad = None
        for name, buf in model[1].named_buffers():
            torch.testing.assert_close(
                buf, ref[1].get_buffer(name), msg=lambda m, n=name: f"{n}: {m}"
            )

    # Eval mode: the running stats (or, without them, the synchronised batch stats).
    model.eval()
    ref.eval()
    x, _ = _global_batch(kind, total, STEPS)
    with torch.no_grad():
        torch.testing.assert_close(model(x[mine]), ref(x)[mine])


def test_matches_batch_norm_on_the_global_batch(world: World) -> None:
    world.run(_equivalence, None)


def test_process_set_synchronises_its_members_only(world3: World) -> None:
    world3.run(_equivalence, [0, 2])


def test_eval_mode_is_torch_batch_norm() -> None:
    torch.manual_seed(1)
    ref = nn.BatchNorm2d(3, momentum=None)
    with torch.no_grad():
        ref.running_mean.uniform_(-1, 1)
        ref.running_var.uniform_(0.5, 2)
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1, 1)
    sync = hvd.SyncBatchNorm(3, momentum=None)
    sync.load_state_dict(ref.state_dict())
    ref.eval()
    sync.eval()
    x = torch.randn(4, 3, 2, 2)
    # No ringtrain.init() here: eval mode with running stats never communicates.
    torch.testing.assert_close(sync(x), ref(x), rtol=0, atol=0)


def test_bad_input_shapes_are_explained() -> None:
    bn = hvd.SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"shape \(N, C, \*\), got 1D(?s:.*)HINT"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match=r"got 4 channels(?s:.*)HINT"):
        bn(torch.randn(2, 4))


def _large_mean_small_spread() -> None:
    # float32 values of mean 1000 and spread 0.1: their squares (1e6) hold only a few digits of
    # the variance (1e-2), so statistics built from x * x in float32 came out wrong by up to
    # 0.8 in the normalized output; torch's own float32 BatchNorm is within 1e-3 of the truth.
    g = torch.Generator().manual_seed(3)
    x = (1000.0 + 0.1 * torch.randn(16, 4, generator=g, dtype=torch.float64)).float()
    truth_bn = nn.BatchNorm1d(4).double()
    truth = truth_bn(x.double())
    n = 16 // rt.size()
    mine = slice(rt.rank() * n, (rt.rank() + 1) * n)
    sync = hvd.SyncBatchNorm(4)
    out = sync(x[mine])
    torch.testing.assert_close(out.double(), truth[mine], rtol=0, atol=1e-2)
    torch.testing.assert_close(sync.running_var.double(), truth_bn.running_var, rtol=1e-4, atol=0)


def test_large_mean_keeps_the_variance(world2: World) -> None:
    world2.run(_large_mean_small_spread)
