"""``horovod.torch.functions``'s names: broadcasting a model's and an optimizer's state, and
Python objects to and from every rank."""

from __future__ import annotations

from ringtrain.collectives.objects import allgather_object, broadcast_object
from ringtrain.engine.state_sync import broadcast_optimizer_state, broadcast_parameters

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]
