"""What a checkpoint reads of the optimizer: the whole contract, as protocols.

:mod:`ringtrain.checkpoint.optimizer_state` (and :mod:`ringtrain.checkpoint.local_state`) reach
the engine only through these, as torch's ``torch.distributed.checkpoint`` reaches what it saves
through its ``Stateful``. The engine's classes satisfy them structurally, and mypy checks that
where the checkpoint takes them (``optimizer_state.distributed``) and in
``tests/typing/seams.py``: renaming ``ShardedStep.layouts`` or ``LocalUpdate.codec_name`` fails
the lint, not a checkpoint test in spawned ranks.

* :class:`Checkpointable`: a ``DistributedOptimizer``;
* :class:`HoldsShards`: its step strategy (:class:`ringtrain.engine.steps.Update`), which says
  whether it holds the state in shards;
* :class:`Shards`: this rank's shards (:class:`ringtrain.engine.sharded.ShardedStep`);
* :class:`LocalState`: the local-update step (:class:`ringtrain.engine.local_update.LocalUpdate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ringtrain.engine.sharded import Layout


class Shards(Protocol):
    """This rank's shards of the optimizer state (ZeRO stage 1)."""

    @property
    def layouts(self) -> Sequence[Layout]:
        """Where this rank's shard of each bucket lies, every bucket in plan order."""
        ...

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """One per bucket with pieces here, in the order of ``layouts``: one param group per
        piece, in piece order."""
        ...


class HoldsShards(Protocol):
    """The step strategy, as a checkpoint asks it for its share of the state."""

    def held(self) -> Shards | None:
        """This rank's shards, or None where the wrapped optimizer holds the state whole."""
        ...


class LocalState(Protocol):
    """A local-update step (``sync_every``): its parameters and its own state."""

    @property
    def params(self) -> Sequence[torch.nn.Parameter]:
        """The parameters it averages, in the order its state follows."""
        ...

    @property
    def fragments(self) -> Sequence[object]:
        """Its outer fragments (``outer_fragments``); a checkpoint compares their number."""
        ...

    @property
    def codec_name(self) -> str:
        """The outer exchange's codec (``outer_compression``)."""
        ...

    @property
    def takes_saved_codec(self) -> bool:
        """Whether a load takes the saved codec (ringtrain chose it; the user gave none)."""
        ...

    def local_state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Its state (anchor, outer optimizer, place in the round, exchanges in flight);
        ``copy=False``: views, for a caller that copies them itself."""
        ...

    def restart(self) -> None:
        """Start afresh from the weights (a load that brought no local-update state)."""
        ...


class Checkpointable(Protocol):
    """A ``DistributedOptimizer`` as a checkpoint saves and loads it."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (its ``param_groups`` and ``state``)."""
        ...

    @property
    def shards_state(self) -> bool:
        """Whether this rank keeps only its shard of the optimizer state."""
        ...

    @property
    def compression(self) -> object:
        """The compressor; its ``state_dict()`` (if it has one) is saved per rank."""
        ...

    @property
    def update(self) -> HoldsShards: ...

    @property
    def local_update(self) -> LocalState | None: ...

    def drain(self) -> None:
        """Finish an overlapped step's pending updates, so the state is final."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
