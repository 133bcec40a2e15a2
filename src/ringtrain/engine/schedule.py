"""Learning the bucket order: watch one step, then agree on one plan across ranks.

The first communicating step of a :class:`~ringtrain.engine.optimizer.DistributedOptimizer` (and
the first after ``requires_grad`` changes) is a *learning step*: gradient hooks only note the
order and time at which each gradient becomes ready and whether it is sparse; nothing is sent
during backward. At ``step()`` every rank contributes its :class:`Observation` to one all_gather
on the engine group, and every rank computes the same :class:`~ringtrain.engine.buckets.Plan`
from the same gathered data (rank 0's order wins, see :func:`ringtrain.engine.buckets.agree`).
That step sends everything at once, with nothing else running, which makes its exchange a
measurement of the rate at which gradients move: every rank then agrees on the slowest rank's
rate (:func:`agree_rate`) and re-plans from the same observations with the bucket floor that rate
calls for (:func:`ringtrain.engine.buckets.timed_floor`). Only that step pays for the agreement;
the plan is frozen until ``requires_grad`` changes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ringtrain.engine import same_settings
from ringtrain.engine.buckets import NOT_SEEN, Observation, ParamSpec
from ringtrain.errors import ConfigError
from ringtrain.transport import group_ops


def specs_of(params: Sequence[torch.Tensor], names: Sequence[str]) -> list[ParamSpec]:
    return [
        ParamSpec(i, names[i], tuple(p.shape), str(p.dtype), str(p.device), p.element_size())
        for i, p in enumerate(params)
    ]


def trainable_of(params: Sequence[torch.Tensor]) -> tuple[bool, ...]:
    return tuple(p.requires_grad for p in params)


class Learner:
    """Notes, for one step, when each parameter's gradient became ready."""

    def __init__(self, n: int) -> None:
        self.position = [NOT_SEEN] * n
        self.ready_us = [0] * n
        self.sparse = [False] * n
        self._next = 0
        self._t0: float | None = None

    def saw(self, index: int, sparse: bool, t: float | None = None) -> None:
        if self.position[index] != NOT_SEEN:
            return
        t = time.perf_counter() if t is None else t
        if self._t0 is None:
            self._t0 = t
        self.position[index] = self._next
        self.ready_us[index] = int((t - self._t0) * 1e6)
        self.sparse[index] = sparse
        self._next += 1

    def observation(self, params: Sequence[torch.Tensor]) -> Observation:
        """The observation, counting gradients that arrived without a hook (e.g. a parameter
        that became trainable this step) as ready last."""
        last = max(self.ready_us, default=0)
        for i, p in enumerate(params):
            if self.position[i] == NOT_SEEN and p.requires_grad and p.grad is not None:
                self.position[i] = self._next
                self.ready_us[i] = last
                self.sparse[i] = bool(p.grad.is_sparse)
                self._next += 1
        return Observation(
            tuple(self.position),
            tuple(self.ready_us),
            tuple(self.sparse),
            trainable_of(params),
            tuple(p.numel() for p in params),
        )


def gather(
    local: Observation, group: Any, size: int, settings: Mapping[str, str] | None = None
) -> list[Observation]:
    """Every rank's observation, rank by rank, gathered on ``group``.

    Two collectives: the parameter count and a digest of ``settings`` first (so a rank with a
    different model or optimizer settings fails with a message instead of a size mismatch deep
    inside Gloo, or wrong sums: :mod:`ringtrain.engine.same_settings`), then the observations.
    """
    if size == 1:
        return [local]
    n = len(local.numel)
    firsts = torch.empty(size * 2, dtype=torch.int64)
    mine = torch.tensor([n, same_settings.digest(settings or {})], dtype=torch.int64)
    group_ops.all_gather_into(firsts, mine, group)
    counts, digests = firsts.view(size, 2).t().tolist()
    if len(set(counts)) != 1:
        raise ConfigError(
            f"the optimizer holds {counts} parameters on ranks 0..{size - 1}.\n"
            "HINT: every rank must build the same model and optimizer."
        )
    if len(set(digests)) != 1:
        same_settings.raise_differences(settings or {}, group, size)
    mine = torch.tensor(local.encode(), dtype=torch.int64)
    gathered = torch.empty(size * mine.numel(), dtype=torch.int64)
    group_ops.all_gather_into(gathered, mine, group)
    return [Observation.decode(row, n) for row in gathered.view(size, -1).tolist()]


def agree_rate(nbytes: int, busy_s: float, group: Any, size: int) -> float:
    """Bytes per second at which ``nbytes`` of gradients moved in ``busy_s`` on the slowest
    rank: one small collective, so every rank holds the same figure (0 if nothing moved)."""
    busy = torch.tensor([busy_s], dtype=torch.float64)
    if size > 1:
        group_ops.allreduce(busy, group, op="max")
    slowest = float(busy.item())
    return nbytes / slowest if slowest > 0 and nbytes > 0 else 0.0
