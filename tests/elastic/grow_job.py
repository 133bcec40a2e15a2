"""An elastic job whose world changes at a known point, for the discovery-script tests.

Like ``elastic_job.py``, ``w`` = (count, sum, sum of squares) of the samples trained on, so it
ends at the undisturbed value only if every sample of every epoch was trained on exactly once.
``MODE=optimizer`` trains it through DistributedOptimizer (the model's weights end at minus
that); otherwise through ``hvd.allreduce``.

``HOLD_AT=b``: in the first world, after the commit that follows batch ``b`` of epoch 0, rank 0
creates ``$SIGNAL_FILE`` (which the test's discovery script reads to change the hosts it offers)
and every rank waits in ``state.check_host_updates()`` until the launcher announces a new world.
So the change happens at a known number of processed samples, and the sampler's split stays
exact. ``HOLD_FOR_LINES=k`` instead holds there until ``$FAILS_FILE`` has ``k`` lines and goes on
in the same world. A rank on host ``$FAIL_HOST`` that was started to join appends a line to
``$FAILS_FILE`` and exits 1 at once. ``VICTIM=<id>`` SIGKILLs that rank at batch ``KILL_AT``
(``SIGNAL_ON_KILL=1``: after creating ``$SIGNAL_FILE``). ``JOIN_FORMING_VICTIM`` kills a rank
started to join as its first world forms (see :func:`die_forming_if_joining`).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

if os.environ.get("RINGTRAIN_ELASTIC_JOIN") == "1" and os.environ.get("FAIL_HOST") == (
    os.environ.get("RINGTRAIN_HOSTNAME")
):
    with open(os.environ["FAILS_FILE"], "a") as f:
        f.write(f"{os.environ['RINGTRAIN_ELASTIC_ID']}\n")
    print(f"failing on purpose on {os.environ['FAIL_HOST']}", file=sys.stderr, flush=True)
    sys.exit(1)

import torch  # after the early exit, which must not wait for torch
import torch.distributed as dist

import ringtrain.torch as hvd
from ringtrain.runtime import membership

N, B, EPOCHS, COMMIT_EVERY = 60, 2, 2, 2
HOLD_AT = int(os.environ.get("HOLD_AT", "-1"))
KILL_AT = int(os.environ.get("KILL_AT", "3"))


def say(*parts: object) -> None:
    print(*parts, flush=True)


def hold(state: hvd.elastic.TorchState) -> None:
    """Wait at a commit: for a new world (HostsUpdatedInterrupt) or for FAILS_FILE's lines."""
    lines = int(os.environ.get("HOLD_FOR_LINES", "0"))
    if hvd.rank() == 0 and os.environ.get("SIGNAL_FILE"):
        Path(os.environ["SIGNAL_FILE"]).touch()
    say(f"hold id={membership.identity()} t={time.time():.3f}")
    while True:
        time.sleep(0.2)
        if lines:
            path = Path(os.environ["FAILS_FILE"])
            seen = len(path.read_text().splitlines()) if path.exists() else 0
            # every rank must leave in the same round: agree on rank 0's view
            if hvd.broadcast_object(seen >= lines, root_rank=0):
                return
        state.check_host_updates()


def die_forming_if_joining() -> None:
    """A rank started to join dies in its first world's ``init()``, after it was announced and
    arrived: ``JOIN_FORMING_VICTIM=create`` as it starts making the world's groups (before it
    posts an address), ``=posted`` right after it posted its address for the third group."""
    how = os.environ.get("JOIN_FORMING_VICTIM")
    if how is None or not membership.joining():
        return
    from ringtrain.runtime import communicator
    from ringtrain.runtime.watched_store import WatchedStore

    def die(*args: object, **kwargs: object) -> None:
        say(f"dying id={membership.identity()} gen={membership.current()} t={time.time():.3f}")
        os.kill(os.getpid(), signal.SIGKILL)

    if how == "create":
        communicator.create = die  # type: ignore[assignment]
        return
    post, posted = WatchedStore.set, []

    def set_then_die(self: WatchedStore, key: str, value: str) -> None:
        post(self, key, value)
        posted.append(key)
        if len(posted) == 3:
            die()

    WatchedStore.set = set_then_die  # type: ignore[method-assign]


def main() -> None:
    die_forming_if_joining()
    hvd.init()
    me = membership.identity()
    say(
        f"start id={me} pid={os.getpid()} rank={hvd.rank()} size={hvd.size()} "
        f"host={socket.gethostname()}"
    )
    victim = int(os.environ.get("VICTIM", "-1"))
    data = torch.arange(1, N + 1, dtype=torch.float64)
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    use_optimizer = os.environ.get("MODE") == "optimizer"
    model = torch.nn.Linear(3, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        op=hvd.Sum,
    )
    state = hvd.elastic.TorchState(
        model=model, optimizer=opt, sampler=sampler, w=torch.zeros(3, dtype=torch.float64), epoch=0
    )
    state.register_reset_callbacks(
        [lambda: say(f"reset id={me} rank={hvd.rank()} size={hvd.size()} t={time.time():.3f}")]
    )

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            order = list(state.sampler)
            for idx in range(-(-len(order) // B)):
                first = membership.current() == 0 and state.epoch == 0
                if me == victim and first and idx == KILL_AT:
                    say(f"kill id={me} t={time.time():.3f}")
                    if os.environ.get("SIGNAL_ON_KILL"):
                        Path(os.environ["SIGNAL_FILE"]).touch()
                    os.kill(os.getpid(), signal.SIGKILL)
                x = data[order[idx * B : (idx + 1) * B]]
                if use_optimizer:
                    opt.zero_grad()
                    feats = torch.stack([torch.ones_like(x), x, x * x], dim=1)
                    model(feats).sum().backward()
                    opt.step()
                else:
                    local = torch.stack(
                        [torch.tensor(float(len(x)), dtype=torch.float64), x.sum(), (x * x).sum()]
                    )
                    state.w += hvd.allreduce(local, op=hvd.Sum, name=f"w.{state.epoch}.{idx}")
                state.sampler.record_batch(idx, B)
                if (idx + 1) % COMMIT_EVERY == 0:
                    state.commit()
                    if first and idx + 1 == HOLD_AT:
                        hold(state)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    final = -model.weight.detach()[0] if use_optimizer else state.w
    w = [int(v) for v in final.tolist()]
    say(
        f"done id={me} pid={os.getpid()} rank={hvd.rank()} size={hvd.size()} "
        f"gen={membership.current()} backend={dist.get_backend()} w={w}".replace(", ", ",")
    )
    hvd.shutdown()


if __name__ == "__main__":
    main()
