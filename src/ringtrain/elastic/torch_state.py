"""TorchState and ObjectState bound to ringtrain's collectives (Horovod's ``hvd.elastic`` names).

Models, optimizers, LR schedulers, :class:`ElasticSampler` and ``ShareSampler`` given to
:class:`TorchState`, and whatever a program registered, are kept by a handler each
(:mod:`~ringtrain.elastic.state_handlers`); anything else is a plain value. ``sync()``
broadcasts rank 0's values after the world was re-formed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ringtrain.collectives.objects import allgather_object, broadcast_object
from ringtrain.elastic import state as base
from ringtrain.elastic import state_handlers
from ringtrain.elastic.sampler import ElasticSampler
from ringtrain.elastic.state_handlers import StateHandler
from ringtrain.errors import ConfigError
from ringtrain.runtime import membership

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

    from ringtrain.checkpoint import Restored

T = TypeVar("T")


def _gather(obj: T) -> list[T]:
    return allgather_object(obj, name=None)


class ObjectState(base.ObjectState):
    """``ObjectState(**values)``: plain values kept across resets, synced from rank 0."""

    def __init__(self, **values: object) -> None:
        super().__init__(broadcast_object, _gather, membership.announced, **values)


class TorchState(ObjectState):
    """``TorchState(model=None, optimizer=None, **values)``, as Horovod's.

    Every keyword becomes an attribute; assigning a new model/optimizer/sampler to one re-commits
    it. Other values (epoch, batch, ...) are kept as plain objects.
    """

    _handlers: dict[str, StateHandler[Any]]

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **values: object,
    ) -> None:
        values.update(model=model, optimizer=optimizer)
        handlers: dict[str, StateHandler[Any]] = {}
        plain: dict[str, object] = {}
        for name, value in values.items():
            handler = state_handlers.handler_for(value)
            if handler is None:
                plain[name] = value
            else:
                handlers[name] = handler
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def on_reset(self) -> None:
        # Before the callbacks, as the restore after a failure: they see the committed state.
        for handler in self._handlers.values():
            if isinstance(handler, state_handlers.OptimizerStateHandler):
                handler.retake_dropped()
        super().on_reset()

    # ---- durable checkpoints (ringtrain.checkpoint) --------------------------------------------

    def _tracked(self) -> _Tracked:
        """The model, optimizer and sampler for ``ringtrain.checkpoint``; the other handlers'
        values (LR schedulers) by name."""
        out = _Tracked()
        for name, handler in self._handlers.items():
            kind = {
                state_handlers.ModelStateHandler: "model",
                state_handlers.OptimizerStateHandler: "optimizer",
                state_handlers.SamplerStateHandler: "sampler",
            }.get(type(handler))
            if kind is None:
                if not hasattr(handler.value, "state_dict"):
                    raise ConfigError(
                        f"TorchState's {name!r} ({type(handler.value).__name__}, kept by "
                        f"{type(handler).__name__}) has no state_dict(): a checkpoint cannot "
                        "save it.\nHINT: give it state_dict() and load_state_dict(), or keep "
                        "it as a plain value (a handler of its own is for commits in memory)."
                    )
                out.others[name] = handler.value
            elif getattr(out, kind) is not None:
                raise ConfigError(
                    f"TorchState holds more than one {kind} ({name!r} and another): a checkpoint "
                    f"saves one.\nHINT: keep one {kind} in the state, or save with "
                    "ringtrain.checkpoint.save directly."
                )
            else:
                setattr(out, kind, handler.value)
        return out

    def save_checkpoint(self, path: str, step: int = 0, keep: int = 0) -> str:
        """Write the current values to disk with :func:`ringtrain.checkpoint.save` (collective):
        the model, optimizer and sampler as it does, LR schedulers and plain values as its
        ``extra``. Returns the checkpoint's directory."""
        from ringtrain import checkpoint

        t = self._tracked()
        extra = {
            "values": {k: getattr(self, k) for k in self._saved_state},
            "handlers": {k: v.state_dict() for k, v in t.others.items()},
        }
        return checkpoint.save(
            path,
            model=t.model,
            optimizer=t.optimizer,
            sampler=t.sampler,
            extra=extra,
            step=step,
            keep=keep,
        )

    def load_checkpoint(self, path: str) -> Restored:
        """Load what :meth:`save_checkpoint` wrote (at any world size), then commit it, so a
        later ``restore()`` comes back to it. Returns :class:`ringtrain.checkpoint.Restored`."""
        from ringtrain import checkpoint

        t = self._tracked()
        restored = checkpoint.load(path, model=t.model, optimizer=t.optimizer, sampler=t.sampler)
        extra = restored.extra or {}
        for name, sd in extra.get("handlers", {}).items():
            if name in t.others:
                t.others[name].load_state_dict(sd)
        for name, value in extra.get("values", {}).items():
            if name in self._saved_state:
                object.__setattr__(self, name, value)
        self.save()
        return restored

    def __setattr__(self, name: str, value: object) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


@dataclass
class _Tracked:
    """What of a :class:`TorchState` a checkpoint saves as such, and the other handlers' values."""

    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    sampler: ElasticSampler | None = None
    others: dict[str, Stateful] = field(default_factory=dict)
