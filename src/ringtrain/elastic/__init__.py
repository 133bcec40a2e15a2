"""Horovod's elastic API (``hvd.elastic``): keep training in the same processes when ranks
leave or join.

    import ringtrain.torch as hvd
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state): ...          # call state.commit() every few batches

    train(state)

Layering: ``state`` (plain Python) < ``sampler`` < ``torch_state`` (binds the collectives) <
``run`` (the retry loop, the launcher's announcements in ``membership``). See docs/elastic.md.
"""

from __future__ import annotations

from ringtrain.elastic.run import run
from ringtrain.elastic.sampler import ElasticSampler
from ringtrain.elastic.state import State
from ringtrain.elastic.torch_state import ObjectState, TorchState
from ringtrain.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = [
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]
