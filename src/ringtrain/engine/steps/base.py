"""The step strategy's interface (see :mod:`ringtrain.engine.steps` for when each is called)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ringtrain.engine.buckets import Plan
from ringtrain.engine.stateful import Shards

if TYPE_CHECKING:
    from ringtrain.engine.exchange import GradientExchange
    from ringtrain.engine.steps.whole import BucketUpdates


class Update(Protocol):
    """How reduced gradients become updated parameters: one object per DistributedOptimizer."""

    def exchanges(self) -> bool:
        """Whether the coming step reduces its gradients."""
        ...

    def bucket_updates(self, exchange: GradientExchange, timer: Any) -> BucketUpdates | None:
        """Synchronous schedule: updates as each bucket is reduced, or None (one update after)."""
        ...

    def bucket_update(self, group: Any) -> Callable[[int], None] | None:
        """Overlapped schedule: bucket ``s``'s update on the updater thread, or None (the
        wrapped optimizer's own, per bucket)."""
        ...

    def step(self, closure: Callable[[], float] | None) -> Any:
        """After the exchange: update every parameter."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state in torch's format (collective for a sharded strategy)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held on this rank."""
        ...

    def held(self) -> Shards | None:
        """This rank's share of the state for checkpoints, or None where it is whole
        (:class:`ringtrain.engine.stateful.HoldsShards`)."""
        ...

    def replan(self, plan: Plan | None) -> None:
        """A bucket plan was agreed (collective where the strategy cuts state by plan)."""
        ...
