"""An elastic job for the launcher tests: sums every sample of EPOCHS epochs into ``w``.

``w`` = (count, sum, sum of squares) of the samples trained on, so the final value equals an
undisturbed run's only if every sample of every epoch was trained on exactly once, whatever the
world size did in between. ``MODE=optimizer`` trains ``w`` through DistributedOptimizer (op=Sum,
SGD lr=1, a loss whose gradient is each sample's (1, x, x^2)), so ``w`` ends at minus that;
``MODE=both`` does both each batch and reports the allreduce's sums as ``sums``. ``MODE=local``
sums through the allreduce and trains a small linear model with local updates (``sync_every=3``,
int8, overlapped, in 2 fragments), reporting a digest of its anchor as ``anchor``. ``VICTIM=<id>``
SIGKILLs that rank mid-epoch, after a commit and one uncommitted batch, in the job's first world
(``KILL=stop``: SIGSTOPs it instead; ``KILL=agent``: its agent instead, so every rank of its host
vanishes at once, as when a host is lost; ``KILL=cut``: it says so and stops, and the test cuts
its host's network link, so the host falls silent; ``KILL=raise``: it raises the error a
collective that failed on its side alone raises, and stays: no rank leaves).
"""

from __future__ import annotations

import faulthandler
import hashlib
import os
import signal
import time

import torch
import torch.distributed as dist

import ringtrain.torch as hvd
from ringtrain.errors import CollectiveAbortedError
from ringtrain.runtime import membership

N, B, EPOCHS, COMMIT_EVERY = 60, 2, 2, 2
KILL_AT = int(os.environ.get("KILL_AT", "5"))


def say(*parts: object) -> None:
    print(*parts, flush=True)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung test dumps the threads
    hvd.init()
    me = membership.identity() if membership.active() else hvd.rank()
    say(f"start id={me} pid={os.getpid()} ppid={os.getppid()} rank={hvd.rank()} size={hvd.size()}")
    victim = int(os.environ.get("VICTIM", "-1"))
    data = torch.arange(1, N + 1, dtype=torch.float64)
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    mode = os.environ.get("MODE", "allreduce")
    use_optimizer = mode in ("optimizer", "both", "local")
    use_allreduce = mode in ("allreduce", "both", "local")
    local_updates = mode == "local"
    model = torch.nn.Linear(3, 1, bias=local_updates).double()
    torch.nn.init.zeros_(model.weight)
    if local_updates:  # the weights averaged at outer steps; the re-formed world agrees them again
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            sync_every=3,
            outer_compression="int8",
            outer_overlap=True,
            outer_delay=1,
            outer_fragments=2,
        )
    else:
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            named_parameters=model.named_parameters(),
            op=hvd.Sum,
        )
    state = hvd.elastic.TorchState(
        model=model,
        optimizer=opt,
        sampler=sampler,
        w=torch.zeros(3, dtype=torch.float64),
        epoch=0,
    )
    state.register_reset_callbacks(
        [
            lambda: say(
                f"reset id={me} rank={hvd.rank()} size={hvd.size()} t={time.time():.3f} "
                f"backend={dist.get_backend()}"
            )
        ]
    )

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            order = list(state.sampler)
            for idx in range(-(-len(order) // B)):
                if (
                    me == victim
                    and membership.current() == 0
                    and state.epoch == 0
                    and idx == KILL_AT
                ):
                    say(f"kill id={me} t={time.time():.3f}")
                    if os.environ.get("KILL") == "raise":  # its own connection broke
                        raise CollectiveAbortedError("a collective failed in transit (the test)")
                    if os.environ.get("KILL") == "cut":  # the test cuts this host's link now
                        time.sleep(3600)
                    if os.environ.get("KILL") == "stop":  # silent, not dead: the heartbeat
                        os.kill(os.getpid(), signal.SIGSTOP)
                    if os.environ.get("KILL") == "agent":
                        os.kill(os.getppid(), signal.SIGKILL)
                        time.sleep(60)  # PR_SET_PDEATHSIG ends this rank with its agent
                    os.kill(os.getpid(), signal.SIGKILL)
                x = data[order[idx * B : (idx + 1) * B]]
                local = torch.stack(
                    [torch.tensor(float(len(x)), dtype=torch.float64), x.sum(), (x * x).sum()]
                )
                if use_optimizer:
                    opt.zero_grad()
                    feats = torch.stack([torch.ones_like(x), x, x * x], dim=1)
                    if local_updates:  # a loss whose minimum the ranks' different data pull apart
                        (model(feats / (N * N)) - 1.0).pow(2).mean().backward()
                    else:
                        model(feats).sum().backward()
                    opt.step()
                if use_allreduce:
                    state.w += hvd.allreduce(local, op=hvd.Sum, name=f"w.{state.epoch}.{idx}")
                state.sampler.record_batch(idx, B)
                if (idx + 1) % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    final = -model.weight.detach()[0] if use_optimizer and not local_updates else state.w
    w = [int(v) for v in final.tolist()]
    sums = f" sums={[int(v) for v in state.w.tolist()]}" if mode == "both" else ""
    if local_updates:
        lu = opt.local_update
        anchor = torch.cat([a.reshape(-1) for a in lu.anchor]).numpy().tobytes()
        sums += f" anchor={hashlib.sha256(anchor).hexdigest()[:16]} copies={lu.copies}"
    say(
        f"done id={me} pid={os.getpid()} rank={hvd.rank()} size={hvd.size()} w={w}{sums}".replace(
            ", ", ","
        )
    )
    hvd.shutdown()


if __name__ == "__main__":
    main()
