"""The overlapped schedule: ``step()`` returns once the buckets are launched; each bucket is
updated on the updater thread as its reduction completes, while the next forward waits per
module for its own parameters (:mod:`ringtrain.engine.overlap`, contract in docs/engine.md).
Any step strategy runs under it: the strategy says how one bucket is updated
(``Update.bucket_update``), this says when.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringtrain.config import Config
from ringtrain.diagnostics import timeline
from ringtrain.engine.exchange import GradientExchange
from ringtrain.engine.overlap import Overlap, check_dense, check_optimizer
from ringtrain.engine.planner import Planner
from ringtrain.engine.steps.base import Update
from ringtrain.errors import ConfigError


class Overlapped:
    """The pending updates of one optimizer, and whether an overlapped step is still open (it
    ran, and no gradient came since)."""

    def __init__(self, optimizer: torch.optim.Optimizer, timeout_s: float) -> None:
        self._overlap = Overlap(optimizer, timeout_s)
        self.open = False

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, comm: Any, config: Config) -> Overlapped | None:
        """The schedule ``config.overlap`` asks for: None for the synchronous one (also where
        there is nothing to overlap: one rank, or outside the process set)."""
        if not config.overlap:
            return None
        if config.shard_optimizer and not comm.is_world and comm.size > 1:
            raise ConfigError(
                "overlap=True with shard_optimizer=True works on the world process set only "
                f"(this optimizer is on process set {comm.set_id}): its all-gathers "
                "need a process group of their own.\n"
                "HINT: drop one of overlap and shard_optimizer on this process set."
            )
        check_optimizer(optimizer)
        if comm.size > 1 and comm.included:
            return cls(optimizer, config.timeout_s)
        return None

    def applies(self, planner: Planner, names: Sequence[str]) -> bool:
        """Whether this step overlaps: the plan is learned and unchanged, and the auto
        compression is not measuring (it times whole steps)."""
        plan = planner.plan
        if planner.learning or planner.exchange is None or plan is None:
            return False
        if planner.tuner is not None and planner.tuner.active:
            return False
        check_dense(plan, names)  # refused at the learning step already (Planner.make_plan)
        return planner.launch_order is not None

    def step(self, planner: Planner, update: Update, progress: Any, watch: Any = None) -> None:
        """Launch what is left and hand the waiting and the per-bucket updates to the updater
        thread: the parameters are updated by the time they are next used. ``watch``: the
        optimizer's WaitWatch (None: none), which watches the updater's wait."""
        exchange = planner.exchange
        assert exchange is not None
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                exchange.flush()
        finally:
            progress.ended()  # dense in overlap: gradients stay as they travelled
            planner.learner = None
        progress.syncs += 1
        update.replan(planner.plan)
        group = planner.updater_group
        watched = (watch, progress.syncs) if watch is not None else None
        self.launch(exchange, planner.launch_order, update.bucket_update(group), group, watched)
        timeline.current().span("step", "STEP_LAUNCHED", t0, time.perf_counter())

    @property
    def pending(self) -> bool:
        return self._overlap.pending

    def drain(self) -> None:
        """Wait for the pending updates, so parameters and state are final."""
        self._overlap.drain()

    def gradient_came(self) -> None:
        """A gradient of the next step: the previous step's updates end before this step's
        buckets reuse the exchange."""
        if self.open:
            self.open = False
            self._overlap.forward_ended()
            self._overlap.drain()

    def launch(
        self,
        exchange: GradientExchange,
        order: Sequence[int] | None,
        update: Callable[[int], None] | None,
        redo_group: Any,
        watch: tuple[Any, int] | None = None,
    ) -> None:
        """The buckets are launched: hand their waiting and their updates to the updater
        thread (``update(s)``, or the wrapped optimizer's own, per bucket)."""
        n = len(exchange.plan.buckets)
        self._overlap.start(
            list(order) if order is not None else list(range(n)),
            [exchange.members(s) for s in range(n)],
            functools.partial(exchange.finish_slot, redo_group=redo_group),
            exchange.reset,
            update,
            watch,
        )
        self.open = True

    def zero_grad(self, params: Sequence[torch.Tensor], set_to_none: bool) -> bool:
        """Deferred per bucket while updates are pending (so the next forward need not wait for
        the whole exchange); False: nothing pending, zero them now."""
        if not self._overlap.pending:
            return False
        self._overlap.zero_grad(params, set_to_none)
        return True

    def close(self) -> None:
        self._overlap.close()
