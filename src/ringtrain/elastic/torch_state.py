"""TorchState and ObjectState bound to ringtrain's collectives (Horovod's ``hvd.elastic`` names).

Models, optimizers, LR schedulers, :class:`ElasticSampler` and ``ShareSampler`` given to
:class:`TorchState` are tracked by a handler each (a deep copy of their ``state_dict`` at each
commit); anything else is a plain value. ``sync()`` broadcasts rank 0's values after the world
was re-formed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from ringtrain.collectives.objects import allgather_object, broadcast_object
from ringtrain.elastic import state as base
from ringtrain.elastic.sampler import ElasticSampler
from ringtrain.elastic.share_sampler import ShareSampler
from ringtrain.engine.state_sync import broadcast_optimizer_state, broadcast_parameters
from ringtrain.errors import ConfigError
from ringtrain.runtime import membership, queries
from ringtrain.runtime import state as runtime

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.optim.optimizer import StateDict

    from ringtrain.checkpoint import Restored

T = TypeVar("T")
# What a handler tracks: a model, an optimizer, an LR scheduler or a sampler (DCP's Stateful).
V = TypeVar("V", bound="Stateful")


def _gather(obj: T) -> list[T]:
    return allgather_object(obj, name=None)


class ObjectState(base.ObjectState):
    """``ObjectState(**values)``: plain values kept across resets, synced from rank 0."""

    def __init__(self, **values: object) -> None:
        super().__init__(broadcast_object, _gather, membership.announced, **values)


class _Handler(Generic[V]):
    def __init__(self, value: V) -> None:
        self.value = value
        self.saved: StateDict = {}
        self.save()

    def set_value(self, value: V) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class _ModelHandler(_Handler[torch.nn.Module]):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class _OptimizerHandler(_Handler[torch.optim.Optimizer]):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler[ElasticSampler]):
    """Each rank records only its own batches: commits and syncs hold the whole world's."""

    def __init__(self, value: ElasticSampler) -> None:
        # No gather when the state is made: a rank joining a running job makes its state
        # alone, and the first sync or commit gathers anyway.
        self.value = value
        self.saved = copy.deepcopy(value.state_dict())

    def _world_state(self) -> StateDict:
        sd = self.value.state_dict()
        if self.saved is not None and self.saved["epoch"] == sd["epoch"]:
            # What the last commit gathered, ranks that have left since included (a host the
            # discovery script removed leaves by an announcement, not a restore).
            sd["processed_indices"] |= self.saved["processed_indices"]
        if runtime.is_initialized():
            sd["processed_indices"] = set().union(*allgather_object(sd["processed_indices"]))
        return sd

    def save(self) -> None:
        self.saved = self._world_state()

    def sync(self) -> None:
        # After a restore every survivor holds the commit's union; after an announcement the
        # ranks hold their own batches since it, and the commit's union: the union covers all.
        self.value.load_state_dict(broadcast_object(self._world_state()))


class _ShareSamplerHandler(_Handler[ShareSampler]):
    """A ShareSampler's position is the same on every rank; its rank and shares are this
    rank's own, so a sync takes rank 0's position and keeps them (a plain value would take
    rank 0's whole sampler). After a world change the shares must fit the new world: kept when
    they do, equal otherwise (``batch_shares="auto"`` measures again; a given list is the
    user's to ``reset``), and the rest of the epoch is split over the ranks now there."""

    def sync(self) -> None:
        sampler = self.value
        sampler.load_state_dict(broadcast_object(sampler.state_dict()))
        size = queries.size()
        shares = sampler.shares if len(sampler.shares) == size else (1.0,) * size
        sampler.reset(shares, queries.rank())


_HANDLERS: list[tuple[type, type[_Handler[Any]]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (torch.optim.lr_scheduler.LRScheduler, _Handler),
    (ElasticSampler, _SamplerHandler),
    (ShareSampler, _ShareSamplerHandler),
]


def _handler_for(value: object) -> _Handler[Any] | None:
    for kind, handler in _HANDLERS:
        if isinstance(value, kind):
            return handler(value)
    return None


class TorchState(ObjectState):
    """``TorchState(model=None, optimizer=None, **values)``, as Horovod's.

    Every keyword becomes an attribute; assigning a new model/optimizer/sampler to one re-commits
    it. Other values (epoch, batch, ...) are kept as plain objects.
    """

    _handlers: dict[str, _Handler[Any]]

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **values: object,
    ) -> None:
        values.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler[Any]] = {}
        plain: dict[str, object] = {}
        for name, value in values.items():
            handler = _handler_for(value)
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

    # ---- durable checkpoints (ringtrain.checkpoint) --------------------------------------------

    def _tracked(self) -> _Tracked:
        """The model, optimizer and sampler for ``ringtrain.checkpoint``; the other handlers'
        values (LR schedulers) by name."""
        out = _Tracked()
        for name, handler in self._handlers.items():
            kind = {
                _ModelHandler: "model",
                _OptimizerHandler: "optimizer",
                _SamplerHandler: "sampler",
            }.get(type(handler))
            if kind is None:
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
