"""An elastic job whose ranks die while the others are in ``state.sync()``.

``EARLY_VICTIM=<id>`` SIGKILLs that rank before it calls ``init()``: the others are in the first
world's ``init()``, waiting for it. ``VICTIM=<id>`` SIGKILLs that rank 1 s after ``init()``, before it syncs: the others wait for
it in the first sync (the sampler's gather needs every rank). Each rank says when it enters
``train`` (in which generation) and what it ends with: the survivors must re-form and agree on
rank 0's model. ``FORMING_VICTIM=<id>`` SIGKILLs that rank in its next world's ``init()``, once
every rank arrived, as it starts making that world's process groups: a second loss while the
world re-forms. ``POSTED_VICTIM=<id>`` with ``POSTED_GROUP=<k>`` SIGKILLs that rank in its next
world right after it posted its address for the world's k-th group.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time

import torch

import ringtrain.torch as hvd
from ringtrain.runtime import communicator, membership
from ringtrain.runtime.watched_store import WatchedStore

N = 12


def say(*parts: object) -> None:
    print(*parts, flush=True)


def die_making_groups_of_next_world() -> None:
    """Wrap the call that makes a world's process groups: past the first world, it kills this
    rank there (after its arrival, before the groups' first exchange)."""
    make = communicator.create

    def create(*args: object, **kwargs: object) -> communicator.Communicator:
        if membership.current() > 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return make(*args, **kwargs)  # type: ignore[arg-type]

    communicator.create = create  # type: ignore[assignment]


def die_after_posting_address_in_next_world(group: int) -> None:
    """Past the first world, kill this rank right after it posted its address for the world's
    ``group``-th process group (counted from 1): its peers read that address and connect to a
    dead port."""
    post = WatchedStore.set
    posted: list[str] = []

    def set_then_die(self: WatchedStore, key: str, value: str) -> None:
        post(self, key, value)
        if membership.current() > 0:
            posted.append(key)
            if len(posted) == group:
                os.kill(os.getpid(), signal.SIGKILL)

    WatchedStore.set = set_then_die  # type: ignore[method-assign]


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung test dumps the threads
    if membership.identity() == int(os.environ.get("FORMING_VICTIM", "-1")):
        die_making_groups_of_next_world()
    if membership.identity() == int(os.environ.get("POSTED_VICTIM", "-1")):
        die_after_posting_address_in_next_world(int(os.environ["POSTED_GROUP"]))
    if membership.identity() == int(os.environ.get("EARLY_VICTIM", "-1")):
        os.kill(os.getpid(), signal.SIGKILL)  # lost while starting, before it ever calls init()
    hvd.init()
    me = membership.identity()
    torch.manual_seed(100 + me)  # each rank's own weights: only a sync makes them agree
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = hvd.elastic.ElasticSampler(torch.arange(N), shuffle=False)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    def on_reset() -> None:
        say(f"reset id={me} generation={membership.current()} size={hvd.size()}")

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> int:
        say(f"enter id={me} generation={membership.current()}")
        for idx, _ in enumerate(state.sampler):
            hvd.allreduce(torch.ones(1), name=f"step.{idx}")
            state.sampler.record_batch(idx, 1)
        state.commit()
        return hvd.size()

    if me == int(os.environ.get("VICTIM", "-1")):
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    size = train(state)
    weights = ",".join(f"{v:.6f}" for v in model.weight.detach().reshape(-1).tolist())
    say(f"done id={me} rank={hvd.rank()} size={size} weights={weights}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
