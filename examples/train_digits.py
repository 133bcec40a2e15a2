"""Train a small CNN on handwritten digits with ringtrain, Horovod style.

The data set is scikit-learn's bundled copy of the UCI handwritten digits (1,797 8x8 images), so
nothing is downloaded. Each rank trains on its own shard; gradients are averaged by
DistributedOptimizer; rank 0 shows a progress bar and evaluates on a held-out split.

    ringtrain run -np 4 -- python examples/train_digits.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import ringtrain.torch as hvd


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-accuracy", type=float, default=0.95)
    parser.add_argument(
        "--save",
        default="/tmp/ringtrain-digits.pt",
        metavar="PATH",
        help="where rank 0 saves the final weights",
    )
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    x_tr, y_tr, x_te, y_te = load(args.seed)
    # Each rank takes every size()-th sample: disjoint shards of equal size (+-1).
    shard = slice(hvd.rank(), None, hvd.size())
    x_tr, y_tr = x_tr[shard], y_tr[shard]

    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    steps = (len(x_tr) + args.batch_size - 1) // args.batch_size
    # Ranks must run the same number of steps: use the smallest shard's count.
    steps = int(hvd.allreduce(torch.tensor(steps), op=hvd.Min, name="steps"))
    bar = tqdm(total=args.epochs * steps, disable=hvd.rank() != 0, unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    samples = 0
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(
            len(x_tr), generator=torch.Generator().manual_seed(args.seed + epoch)
        )
        for i in range(steps):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            loss.backward()
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

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_te).argmax(1) == y_te).float().mean().item()
    if hvd.rank() == 0:
        print(
            f"ranks: {hvd.size()}  final loss: {mean_loss:.4f}  test accuracy: {accuracy:.2%}  "
            f"throughput: {throughput:,.0f} samples/s  train time: {elapsed:.2f} s"
        )
        torch.save(model.state_dict(), args.save)
    hvd.shutdown()
    if accuracy < args.target_accuracy:
        raise SystemExit(f"accuracy {accuracy:.2%} is below the target {args.target_accuracy:.0%}")


if __name__ == "__main__":
    main()
