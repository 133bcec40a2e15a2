"""Batch norm whose batch statistics cover every rank's batch, as Horovod's ``SyncBatchNorm``.

In training mode each rank sums its inputs and their squares per channel (in float64; the squares
are of the deviations from the rank's own mean, so a large mean does not drown the variance) and
counts its elements; one differentiable allreduce (Sum) of that vector gives the statistics of the
global batch, so ranks may hold batches of different sizes. The allreduce's gradient is the
allreduce of the gradients, which is exactly the cross-rank term batch norm's backward needs.
Running statistics are updated from the global mean and unbiased variance, as torch's BatchNorm
updates them from its batch. In eval mode (with running stats) and at process-set size 1, this
is torch's BatchNorm, call for call.

Limits: every rank of the process set must call forward (and backward) of each such layer in the
same order, as with any unnamed collective; a rank that skips one leaves its peers waiting.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ringtrain.collectives import ops
from ringtrain.collectives.reduce_ops import Sum
from ringtrain.runtime.process_sets import ProcessSet


class SyncBatchNorm(_BatchNorm):
    """``torch.nn.BatchNorm{1,2,3}d`` with statistics over the batches of all ranks.

    Takes inputs of shape ``(N, C, *)`` with ``C == num_features``. ``process_set`` limits the
    synchronisation to a set of ranks (default: the whole job); only its members may call it.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: ProcessSet | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of shape (N, C, *), got {input.dim()}D "
                f"shape {tuple(input.shape)}.\n"
                "HINT: add a batch dimension, e.g. x.unsqueeze(0) for a single sample."
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got {input.shape[1]} channels in dimension 1 "
                f"of an input of shape {tuple(input.shape)}.\n"
                "HINT: num_features must equal the channel dimension (dim 1) of the input."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        uses_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not uses_batch_stats:
            return super().forward(input)
        ctl = ops.controller_of(self.process_set)
        if ctl.comm.size == 1:
            return super().forward(input)
        factor = self._running_stats_factor()
        mean, var, count = self._global_moments(input, ctl.auto_name("sync_batch_norm"))
        if factor is not None and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                self.running_mean.mul_(1.0 - factor).add_(mean.to(self.running_mean.dtype) * factor)
                self.running_var.mul_(1.0 - factor).add_(
                    unbiased.to(self.running_var.dtype) * factor
                )
        return self._normalize(input, mean, var)

    def _running_stats_factor(self) -> float | None:
        """Count this batch and return the weight of its statistics, or None if not tracked."""
        if not (self.training and self.track_running_stats) or self.num_batches_tracked is None:
            return None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average, as torch's BatchNorm
            return 1.0 / float(self.num_batches_tracked)
        return float(self.momentum)

    def _global_moments(
        self, input: torch.Tensor, name: str
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Mean and biased variance per channel over all ranks' batches, and the element count."""
        dims = [0, *range(2, input.dim())]
        # Squares of fp16/bf16 values overflow or lose digits before the float64 sum sees them.
        x = input.float() if input.is_floating_point() and input.element_size() < 4 else input
        local_count = input.numel() // max(input.shape[1], 1)
        # Squares of the deviations from this rank's own mean: x * x in float32 rounds a small
        # variance under a large mean away. Any constant shift k is exact, as the sums show:
        # sum(x) = s1 + n*k and sum(x^2) = s2 + 2*k*s1 + n*k^2 (float64).
        shape = (1, -1) + (1,) * (input.dim() - 2)
        k = (x.detach().sum(dims, dtype=torch.float64) / max(local_count, 1)).to(x.dtype)
        d = x - k.view(shape)
        s1 = d.sum(dims, dtype=torch.float64)
        s2 = (d * d).sum(dims, dtype=torch.float64)
        k64, n = k.to(torch.float64), float(local_count)
        stats = torch.cat(
            [
                s1 + n * k64,
                s2 + 2.0 * k64 * s1 + n * k64 * k64,
                torch.tensor([n], dtype=torch.float64, device=input.device),
            ]
        )
        total = ops.allreduce(stats, name=name, op=Sum, process_set=self.process_set)
        c = self.num_features
        count = float(total[2 * c].item())
        if count <= 1:
            raise ValueError(
                f"SyncBatchNorm expects more than 1 value per channel when training, got {count:.0f} "
                f"over all ranks (input shape here {tuple(input.shape)}).\n"
                "HINT: use a larger batch, or put the layer in eval mode (module.eval())."
            )
        mean = total[:c] / count
        # E[x^2] - E[x]^2 in float64: the cancellation costs digits only when |mean| >> std.
        var = (total[c : 2 * c] / count - mean * mean).clamp_min(0.0)
        return mean, var, count

    def _normalize(
        self, input: torch.Tensor, mean: torch.Tensor, var: torch.Tensor
    ) -> torch.Tensor:
        shape = (1, self.num_features) + (1,) * (input.dim() - 2)
        invstd = torch.rsqrt(var + self.eps)
        out = (input - mean.to(input.dtype).view(shape)) * invstd.to(input.dtype).view(shape)
        if self.weight is not None:
            out = out * self.weight.to(input.dtype).view(shape)
        if self.bias is not None:
            out = out + self.bias.to(input.dtype).view(shape)
        return out
