"""The class of a DistributedOptimizer instance: one per wrapped optimizer's class, derived from
both and named as the wrapped one, as Horovod's is (it builds the class with ``type()``), so
``isinstance(opt, torch.optim.Adam)`` holds for a wrapped Adam and ``type(opt).__name__`` is
"Adam". The wrapper comes first in the class's order: its methods win over the wrapped class's,
whose own methods run only on the wrapped optimizer itself."""

from __future__ import annotations

import torch

_CLASSES: dict[tuple[type, type], type] = {}


def for_wrapped(wrapper: type, optimizer: object) -> type:
    """The class to make a ``wrapper`` of ``optimizer`` in; ``wrapper`` itself for what it
    refuses (not an optimizer, one already wrapped) and where Python cannot combine the two."""
    base = type(optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer) or issubclass(base, wrapper):
        return wrapper
    key = (wrapper, base)
    if key not in _CLASSES:
        try:
            _CLASSES[key] = type(base.__name__, (wrapper, base), {"__module__": wrapper.__module__})
        except TypeError:  # e.g. two classes with __slots__ of their own
            _CLASSES[key] = wrapper
    return _CLASSES[key]
