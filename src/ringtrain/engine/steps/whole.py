"""The whole step: the wrapped optimizer updates every parameter it holds.

After a synchronous exchange each bucket's parameters can be updated as soon as its reduction
is done, while later buckets are still on the wire (:class:`BucketUpdates`): the same
computation as one ``optimizer.step()`` (per-parameter optimizers only, the sums untouched), so
the weights are bit for bit the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ringtrain.diagnostics import timeline
from ringtrain.engine.buckets import Plan
from ringtrain.engine.exchange import GradientExchange
from ringtrain.engine.overlap import bucket_groups, step_subset, steps_alike_by_bucket
from ringtrain.errors import InternalError


class WholeStep:
    """:class:`ringtrain.engine.steps.Update` for the unsharded optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, by_bucket: bool) -> None:
        self._optimizer = optimizer
        # Whether a synchronous step may update bucket by bucket (not with sparse_as_dense or
        # compression="auto"; the optimizer is checked at each step: step hooks may come).
        self._by_bucket = by_bucket

    def exchanges(self) -> bool:
        return True

    def bucket_updates(self, exchange: GradientExchange, timer: Any) -> BucketUpdates | None:
        if not (self._by_bucket and steps_alike_by_bucket(self._optimizer)):
            return None
        if exchange.plan.sparse:
            return None
        return BucketUpdates(self._optimizer, exchange, timer)

    def bucket_update(self, group: Any) -> Callable[[int], None] | None:
        return None

    def step(self, closure: Callable[[], float] | None) -> Any:
        opt = self._optimizer
        return opt.step(closure) if closure is not None else opt.step()

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    @property
    def state_bytes(self) -> int:
        return tensor_bytes(self._optimizer.state)

    def held(self) -> None:
        return None

    def replan(self, plan: Plan | None) -> None:
        pass


class BucketUpdates:
    """One step's updates bucket by bucket (:meth:`WholeStep.bucket_updates`)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, exchange: GradientExchange, timer: Any = None
    ) -> None:
        self._optimizer = optimizer
        self._timer = timer  # straggler reports: an update is compute, not waiting
        members = [exchange.members(s) for s in range(len(exchange.plan.buckets))]
        # The hyper-parameters as at step(), as one optimizer.step() would read them.
        self._groups = bucket_groups(optimizer, members)
        self._done = [False] * len(members)
        in_buckets = {id(p) for m in members for p in m}
        self._rest = [
            p
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) not in in_buckets
        ]

    def update(self, s: int) -> None:
        if self._timer is not None:
            self._timer.wait_done()
        t0 = time.perf_counter()
        step_subset(self._optimizer, self._groups[s])
        self._done[s] = True
        if self._timer is not None:
            self._timer.wait_started()
        timeline.current().span("update", "OPTIMIZER_STEP", t0, time.perf_counter(), {"bucket": s})

    def finish(self) -> bool:
        """After the exchange: whether every bucket was updated (if not, none was: the caller
        steps the optimizer as a whole). Parameters outside every bucket step now."""
        if not all(self._done):
            if any(self._done):
                raise InternalError("the step updated some buckets and not others")
            return False
        rest = [p for p in self._rest if p.grad is not None]
        if rest:
            step_subset(self._optimizer, bucket_groups(self._optimizer, [rest])[0])
        return True


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in an optimizer's ``state`` (parameter -> dict)."""
    return sum(
        v.numel() * v.element_size()
        for st in state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )
