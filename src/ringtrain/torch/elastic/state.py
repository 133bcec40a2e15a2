"""``horovod.torch.elastic.state``'s names: ``TorchState`` and the ``ObjectState`` it builds on
(:mod:`ringtrain.elastic.torch_state`).

Horovod's state handler registry (``get_handler_registry``, ``StateHandler``...) is its
internals: ringtrain's handlers are private, and ``TorchState`` tracks anything with a
``state_dict`` without one.
"""

from __future__ import annotations

from ringtrain.elastic.torch_state import ObjectState, TorchState

__all__ = ["ObjectState", "TorchState"]
