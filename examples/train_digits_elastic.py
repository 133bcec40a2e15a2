"""Train the digits CNN elastically: a rank or host can die and the others carry on in place.

The elastic version of ``train_digits.py`` (same model and data), written with Horovod's elastic
API: an :class:`~ringtrain.elastic.ElasticSampler` splits the samples not yet seen this epoch over
whoever is left, a ``TorchState`` holds the model, optimizer, sampler and epoch, and a commit
every few batches bounds what a failure costs. Kill a rank mid-run (``kill -9``) and the
survivors roll back to the last commit, re-form a smaller world in the same processes, and
finish with the same accuracy as an undisturbed run (see docs/elastic.md)::

    ringtrain run -np 3 --min-np 2 -- python examples/train_digits_elastic.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from train_digits import DigitsNet, load  # the same model and data (this script's folder)

import ringtrain.torch as hvd


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit-every", type=int, default=5, metavar="BATCHES")
    parser.add_argument("--target-accuracy", type=float, default=0.95)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load(args.seed)
    dataset = TensorDataset(x_tr, y_tr)
    # The whole training set, split over the current world; no sample twice in an epoch, even
    # across a change of world.
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    def on_reset() -> None:  # the world changed size: keep the per-rank learning rate
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"world re-formed: {hvd.size()} ranks, resuming epoch {state.epoch + 1}")

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            model.train()
            total, batches = torch.zeros(()), 0
            for idx, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                total += loss.detach()
                batches += 1
                state.sampler.record_batch(idx, args.batch_size)
                if (idx + 1) % args.commit_every == 0:
                    state.commit()
            # A world re-formed near an epoch's end may leave a rank no batch of it: count them.
            sums = hvd.allreduce(
                torch.stack([total, torch.tensor(float(batches))]),
                op=hvd.Sum,
                name=f"loss.{state.epoch}",
            )
            mean_loss = (sums[0] / sums[1].clamp(min=1.0)).item()
            if hvd.rank() == 0:
                print(
                    f"epoch {state.epoch + 1}/{args.epochs}  ranks {hvd.size()}  "
                    f"loss {mean_loss:.3f}",
                    flush=True,
                )
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)  # at the END of an epoch
            state.commit()

    start = time.perf_counter()
    train(state)
    elapsed = time.perf_counter() - start

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    if hvd.rank() == 0:
        print(
            f"ranks: {hvd.size()}  test accuracy: {accuracy:.2%}  train time: {elapsed:.2f} s",
            flush=True,
        )
    hvd.shutdown()
    if accuracy < args.target_accuracy:
        raise SystemExit(f"accuracy {accuracy:.2%} is below the target {args.target_accuracy:.0%}")


if __name__ == "__main__":
    main()
