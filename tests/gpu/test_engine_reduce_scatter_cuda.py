"""The sharded step with reduce-scattered CUDA gradients (issue 24), against the allreduce.

Skipped where CUDA is not available (CI has no GPU): run ``pytest tests/gpu`` on a GPU machine.
With a GPU per rank the buckets are reduce-scattered over NCCL (``reduce_scatter_tensor``); with
one GPU shared by both ranks NCCL is not used and they go through host memory on the engine's
Gloo group. Either way: the weights match the allreduce-based sharded step within float
rounding, on every rank alike, with and without fp16.
"""

from __future__ import annotations

import pytest
import torch
from _cuda import classifier, train

import ringtrain as rt
from ringtrain.testing import spawn

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: torch.cuda.is_available() is False",
    ),
    pytest.mark.timeout(600),
]


def _train(scatter: bool, codec: str) -> torch.Tensor:
    model = classifier(0)
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        compression=codec,
        shard_optimizer=True,
        reduce_scatter=scatter,
        fusion_threshold_bytes=2048,
        link_class="slow",
    )
    train(model, opt, range(4))
    assert opt._exchange is not None and opt._exchange.scatters == scatter
    opt.remove_hooks()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _compare(codec: str) -> tuple[float, bool]:
    ring, reference = _train(True, codec), _train(False, codec)
    every = rt.allgather(ring.reshape(1, -1))
    return float((ring - reference).abs().max()), bool(
        torch.equal(every, every[:1].expand_as(every))
    )


@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_cuda_buckets_reduce_scatter_like_the_allreduce(codec: str) -> None:
    for gap, alike in spawn.world(2).run(_compare, codec, timeout=300):
        assert alike and gap <= 1e-4, (gap, alike)
