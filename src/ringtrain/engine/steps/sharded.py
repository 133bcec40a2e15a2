"""The sharded step (ZeRO stage 1) as a step strategy: this rank keeps and steps the optimizer
state of its shard of every bucket (:class:`ringtrain.engine.sharded.ShardedStep`), then the
parameters are all-gathered. The state is cut by the bucket plan, so a new plan cuts it anew
(collective, like the plan); full state loaded into the wrapped optimizer (``load_state_dict``,
a broadcast, a step before the first plan) is absorbed into the shards at the next step.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringtrain.engine import sharded
from ringtrain.engine.buckets import Plan
from ringtrain.engine.exchange import GradientExchange
from ringtrain.engine.steps.whole import BucketUpdates, tensor_bytes
from ringtrain.errors import ConfigError


def closure_refused() -> ConfigError:
    """``step(closure)`` with ``shard_optimizer=True``: refused at every step, the first too,
    and at any world size (a one-rank trial fails as the job would)."""
    return ConfigError(
        "step(closure) is not supported with shard_optimizer=True: the closure would run on "
        "the whole model while only a shard steps.\n"
        "HINT: compute the loss before step(), or use shard_optimizer=False."
    )


class ShardedUpdate:
    """:class:`ringtrain.engine.steps.Update` for ``shard_optimizer=True`` (2 or more ranks)."""

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Any) -> None:
        self._optimizer = optimizer
        self._comm = comm  # its engine group carries the all-gathers
        self._params: list[torch.nn.Parameter] = []
        self._names: list[str] = []
        self._plan: Plan | None = None
        self._shards: sharded.ShardedStep | None = None

    def set_params(self, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        self._params, self._names = list(params), list(names)

    # ---- the public state API (checkpoints) ----------------------------------------------------

    @property
    def shards(self) -> sharded.ShardedStep | None:
        """This rank's shards (``layouts``, ``optimizers``: one param group per piece in
        piece order); None before the first sharded step."""
        return self._shards

    def held(self) -> sharded.ShardedStep | None:
        return self._shards

    # ---- Update ----------------------------------------------------------------------------------

    def exchanges(self) -> bool:
        return True

    def bucket_updates(self, exchange: GradientExchange, timer: Any) -> BucketUpdates | None:
        return None  # the shards step after the whole exchange (each needs its bucket's sum)

    def bucket_update(self, group: Any) -> Callable[[int], None] | None:
        # Each bucket: this rank's shard steps, then the bucket's parameters are all-gathered;
        # a module's forward waits for its own bucket's gather only. The hyper-parameters as at
        # step(): a scheduler may change them before the update.
        shards = self._current()
        return functools.partial(
            shards.step_bucket, settings=shards.hyper_parameters(), group=group
        )

    def step(self, closure: Callable[[], float] | None) -> Any:
        if closure is not None:
            raise closure_refused()  # GradientPath.step refuses it first, before the exchange
        if self._plan is None:
            # No plan yet (no gradient reached the exchange): the wrapped optimizer steps whole.
            return self._optimizer.step()
        self._current().step()
        return None

    def replan(self, plan: Plan | None) -> None:
        self._plan = plan

    @property
    def state_bytes(self) -> int:
        total = self._shards.state_bytes() if self._shards is not None else 0
        return total + tensor_bytes(self._optimizer.state)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict with the full state gathered from every rank's
        shards (collective), so it loads into a sharded or an unsharded optimizer alike."""
        inner = self._optimizer
        if self._shards is None:
            return inner.state_dict()
        full = self._shards.gather_state()
        saved = inner.state
        state: collections.defaultdict[Any, dict[str, Any]] = collections.defaultdict(dict)
        state.update({self._params[i]: st for i, st in full.items()})
        state.update({p: st for p, st in saved.items() if st})  # not absorbed yet: newer
        inner.state = state
        try:
            return inner.state_dict()
        finally:
            inner.state = saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)
        if self._shards is not None:
            self._absorb()

    # ---- inside ----------------------------------------------------------------------------------

    def _current(self) -> sharded.ShardedStep:
        """The shards of the current plan, holding all of the optimizer's state. Collective
        when the plan is new (every rank reaches it at the same step)."""
        plan = self._plan
        assert plan is not None
        if self._shards is None or self._shards.plan.digest != plan.digest:
            # A new plan cuts new shards: carry the state over (collective, like the plan).
            full = self._shards.gather_state() if self._shards is not None else {}
            self._shards = sharded.ShardedStep(
                plan,
                self._params,
                self._names,
                self._optimizer,
                self._comm.group("engine"),
                self._comm.set_rank,
                self._comm.size,
            )
            if full:
                self._shards.load_state(full)
        self._absorb()
        return self._shards

    def _absorb(self) -> None:
        """Full state in the wrapped optimizer (loaded, broadcast, or from a step before the
        first plan) goes into the shards, and leaves the wrapped optimizer."""
        assert self._shards is not None
        inner = self._optimizer.state
        full = {i: dict(inner[p]) for i, p in enumerate(self._params) if inner.get(p)}
        if full:
            self._shards.load_state(full)
        inner.clear()
