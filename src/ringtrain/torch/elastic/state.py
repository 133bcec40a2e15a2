"""``horovod.torch.elastic.state``'s names: ``TorchState``, the ``ObjectState`` it builds on
(:mod:`ringtrain.elastic.torch_state`), and the state handlers with their registry
(:mod:`ringtrain.elastic.state_handlers`), for programs that register handlers of their own.
"""

from __future__ import annotations

from ringtrain.elastic.state_handlers import (
    ModelStateHandler,
    OptimizerStateHandler,
    SamplerStateHandler,
    StateHandler,
    get_handler_registry,
    set_handler_registry,
)
from ringtrain.elastic.torch_state import ObjectState, TorchState

__all__ = [
    "ModelStateHandler",
    "ObjectState",
    "OptimizerStateHandler",
    "SamplerStateHandler",
    "StateHandler",
    "TorchState",
    "get_handler_registry",
    "set_handler_registry",
]
