"""Train a small CNN on handwritten digits with ringtrain, Horovod style.

The data set is scikit-learn's bundled copy of the UCI handwritten digits (1,797 8x8 images), so
nothing is downloaded. Each rank trains on its own shard; gradients are averaged by
DistributedOptimizer; rank 0 shows a progress bar and evaluates on a held-out split.

    ringtrain run -np 4 -- python examples/train_digits.py

Hosts of unequal speed: ``--batch-shares auto`` lets ringtrain measure each rank's rate and give
the faster ranks more of each global batch (a ShareSampler cuts it, the optimizer weighs each
rank by the samples it took); ``--slow-rank 1`` slows one rank to try it on one machine:

    ringtrain run -np 2 -- python examples/train_digits.py --batch-shares auto --slow-rank 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import ringtrain.torch as hvd
from ringtrain.elastic.share_sampler import ShareSampler


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def load(seed: int) -> tuple[torch.Tensor, ...]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te


def equal_batches(n: int, batch_size: int, steps: int, seed: int) -> Iterator[torch.Tensor]:
    """This rank's batches of an epoch of its own shard: ``steps`` of ``batch_size``."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return (order[i * batch_size : (i + 1) * batch_size] for i in range(steps))


def share_batches(
    sampler: ShareSampler, optimizer: hvd.DistributedOptimizer, epoch: int
) -> Iterator[torch.Tensor]:
    """This rank's part of each global batch of ``epoch`` under batch_shares: cut by the shares
    in force (given, or auto's latest, read between steps), and the optimizer told the samples
    every rank takes, so the step is the whole global batch's."""
    sampler.set_epoch(epoch)
    taken: tuple[float, ...] | None = None
    parts = iter(sampler)
    while _left(sampler) > 0:
        now = optimizer.batch_shares
        if now is not None and now != taken:  # new shares (auto's first or next decision)
            sampler.reset(now, hvd.rank())
        counts = sampler.counts(min(sampler.global_batch_size, _left(sampler)))
        if min(counts) == 0:
            return  # a short last batch with no sample for some rank: left out this epoch
        optimizer.set_batch_shares(counts)
        taken = tuple(float(c) for c in counts)
        yield torch.tensor(next(parts), dtype=torch.int64)
        sampler.record_batch()


def _left(sampler: ShareSampler) -> int:
    return len(sampler.dataset) - sampler.position


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank (on average)")
    parser.add_argument("--lr", type=float, default=0.01, help="scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-accuracy", type=float, default=0.95)
    parser.add_argument(
        "--batch-shares",
        default="",
        metavar="auto|A,B,...",
        help="each rank's share of the global batch: 'auto' (measured) or one number per rank",
    )
    parser.add_argument(
        "--slow-rank", type=int, default=-1, help="this rank sleeps to run slower (a test)"
    )
    parser.add_argument(
        "--slow-factor", type=float, default=2.0, help="--slow-rank's 1/speed (default 2)"
    )
    parser.add_argument(
        "--save",
        default="/tmp/ringtrain-digits.pt",
        metavar="PATH",
        help="where rank 0 saves the final weights",
    )
    return parser.parse_args()


def main() -> None:
    args = parse()
    hvd.init()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load(args.seed)
    shares = None
    if args.batch_shares:
        shares = (
            "auto"
            if args.batch_shares == "auto"
            else [float(v) for v in args.batch_shares.split(",")]
        )
    slow = args.slow_factor - 1 if hvd.rank() == args.slow_rank else 0.0

    model = DigitsNet()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(), batch_shares=shares
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if shares is None:
        # Each rank takes every size()-th sample: disjoint shards of equal size (+-1).
        shard = slice(hvd.rank(), None, hvd.size())
        x_tr, y_tr = x_tr[shard], y_tr[shard]
        steps = (len(x_tr) + args.batch_size - 1) // args.batch_size
        # Ranks must run the same number of steps: use the smallest shard's count.
        steps = int(hvd.allreduce(torch.tensor(steps), op=hvd.Min, name="steps"))
    else:
        # One global batch of batch_size x size() per step, cut by the shares.
        sampler = ShareSampler(
            x_tr, args.batch_size * hvd.size(), [1.0] * hvd.size(), hvd.rank(), seed=args.seed
        )
        steps = len(sampler)
    bar = tqdm(total=args.epochs * steps, disable=hvd.rank() != 0, unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    samples = 0
    for epoch in range(args.epochs):
        model.train()
        if shares is None:
            batches = equal_batches(len(x_tr), args.batch_size, steps, args.seed + epoch)
        else:
            batches = share_batches(sampler, optimizer, epoch)
        for idx in batches:
            t0 = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
            if slow:  # as a slower host would: its forward and backward take 1/speed as long
                time.sleep(slow * (time.perf_counter() - t0))
            optimizer.step()
            samples += len(idx)
            bar.update()
        mean_loss = hvd.allreduce(loss.detach(), name=f"loss.{epoch}").item()
        bar.set_postfix(epoch=epoch + 1, loss=f"{mean_loss:.3f}")
    bar.close()
    elapsed = time.perf_counter() - start
    throughput = hvd.allreduce(
        torch.tensor(samples / elapsed), op=hvd.Sum, name="throughput"
    ).item()
    taken = hvd.allgather_object(samples)

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    if hvd.rank() == 0:
        print(
            f"ranks: {hvd.size()}  final loss: {mean_loss:.4f}  test accuracy: {accuracy:.2%}  "
            f"throughput: {throughput:,.0f} samples/s  train time: {elapsed:.2f} s"
            + (f"  samples per rank: {taken}" if shares is not None else "")
        )
        torch.save(model.state_dict(), args.save)
    hvd.shutdown()
    if accuracy < args.target_accuracy:
        raise SystemExit(f"accuracy {accuracy:.2%} is below the target {args.target_accuracy:.0%}")


if __name__ == "__main__":
    main()
