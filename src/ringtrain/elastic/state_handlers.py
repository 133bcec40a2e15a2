"""How :class:`~ringtrain.elastic.torch_state.TorchState` keeps each kind of value: Horovod's
state handlers and their registry (``horovod.torch.elastic.state``).

A handler holds one value and knows how to ``save`` it (at each commit), ``restore`` it (after a
failure) and ``sync`` it (rank 0's, after the world was re-formed). The registry is a list of
``(type, handler class)`` pairs; ``TorchState`` gives each keyword the handler of the first type
it is an instance of, and keeps anything else as a plain value (a deep copy, replaced on
restore). ``get_handler_registry()`` returns the list itself, so a program adds its own
handler as Horovod's do::

    class ScalerHandler(StateHandler):
        def __init__(self, scaler):
            super().__init__(scaler)
            self.saved = copy.deepcopy(scaler.state_dict())
        def save(self): ...
        def restore(self): ...
        def sync(self): ...

    get_handler_registry().append((torch.amp.GradScaler, ScalerHandler))

Only states made afterwards use it. Beyond Horovod's three (models, optimizers,
``ElasticSampler``), the registry holds LR schedulers and ``ShareSampler``.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from ringtrain.collectives.objects import allgather_object, broadcast_object
from ringtrain.elastic.sampler import ElasticSampler
from ringtrain.elastic.share_sampler import ShareSampler
from ringtrain.engine.state_sync import broadcast_optimizer_state, broadcast_parameters
from ringtrain.runtime import queries
from ringtrain.runtime import state as runtime

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.optim.optimizer import StateDict

T = TypeVar("T")
# What ringtrain's handlers track: values with a state_dict (DCP's Stateful).
V = TypeVar("V", bound="Stateful")


class StateHandler(Generic[T]):
    """Horovod's base class: ``value``; a subclass says how to save, restore and sync it."""

    def __init__(self, value: T) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: T) -> None:
        """A new value assigned to the state's attribute: it is committed at once."""
        self.value = value
        self.save()


class StateDictHandler(StateHandler[V]):
    """A deep copy of the value's ``state_dict`` at each commit; rank 0's on a sync."""

    def __init__(self, value: V) -> None:
        super().__init__(value)
        self.saved: StateDict = {}
        self.save()

    def save(self) -> None:
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict()))


class ModelStateHandler(StateDictHandler[torch.nn.Module]):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0)


class OptimizerStateHandler(StateDictHandler[torch.optim.Optimizer]):
    def retake_dropped(self) -> None:
        """After a re-formed world: a sharded optimizer's state lived in the old world's shards,
        dropped with it, and after a HostsUpdatedInterrupt nothing restored it. Take the last
        commit's, the state it had when the interrupt came from ``commit()`` (a script that
        calls ``check_host_updates()`` itself loses the steps since). Every rank calls it."""
        if self.saved.get("state") and not self.value.state_dict()["state"]:
            self.restore()

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class SamplerStateHandler(StateDictHandler[ElasticSampler]):
    """Each rank records only its own batches: commits and syncs hold the whole world's."""

    def __init__(self, value: ElasticSampler) -> None:
        # No gather when the state is made: a rank joining a running job makes its state
        # alone, and the first sync or commit gathers anyway.
        StateHandler.__init__(self, value)
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


class ShareSamplerHandler(StateDictHandler[ShareSampler]):
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


Registry = list[tuple[type, type[StateHandler[Any]]]]

_registry: Registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (torch.optim.lr_scheduler.LRScheduler, StateDictHandler),
    (ElasticSampler, SamplerStateHandler),
    (ShareSampler, ShareSamplerHandler),
]


def get_handler_registry() -> Registry:
    """The registry itself (a list of ``(type, handler class)``, searched in order)."""
    return _registry


def set_handler_registry(registry: Registry) -> None:
    """Replace the registry (for the states made afterwards)."""
    global _registry
    _registry = registry


def handler_for(value: object) -> StateHandler[Any] | None:
    """The handler of the first registered type ``value`` is an instance of, or None."""
    for kind, handler in _registry:
        if isinstance(value, kind):
            return handler(value)
    return None
