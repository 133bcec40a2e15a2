"""ShareSampler: each rank takes its share of every global batch (``batch_shares``).

With ``DistributedOptimizer(batch_shares=...)`` ranks take unequal parts of each global batch.
This batch sampler cuts the epoch's order (the same on every rank: seeded by ``seed`` and the
epoch) into global batches of ``global_batch_size`` and hands rank r its part of each, sized by
:func:`split_counts`: every sample of the epoch goes to exactly one rank once (the last global
batch may be short; it is split by the same shares), and every rank gets at least one sample of
each global batch that has as many samples as ranks.

Its position is one number, the samples of the epoch's order already handed out (every rank
consumes global batches in step, so the consumed samples are a prefix of the order), counted by
:meth:`ShareSampler.record_batch`: :meth:`~ShareSampler.state_dict` saves it, :meth:`~ShareSampler.load_state_dict` resumes there,
and :meth:`~ShareSampler.reset` splits what is left over a new world or new shares (an elastic
change) without repeating or skipping a sample. ``ringtrain.checkpoint.save(...,
sampler=share_sampler)`` saves the position and ``load`` resumes there, at any shares and world
size (docs/checkpoint.md).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence, Sized

import torch.utils.data

from ringtrain.errors import ConfigError

# What fixes an epoch's order besides the epoch: a saved position holds only in the same order.
ORDER_FACTS = ("length", "seed", "shuffle")


def split_counts(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` samples cut in proportion to ``shares`` (largest remainder; ties to the lower
    rank): the counts sum to ``total`` and are the same on every rank. Every rank gets at least
    one sample when there are as many as ranks: a rank with none would have no step to take (a
    mean loss over no samples is NaN), and a program could only leave the batch out, losing its
    samples; a share small enough to round to none happens when a rank is measured very slow
    (``batch_shares="auto"`` on a busy machine) or the batch is an epoch's short last one."""
    if not shares or any(not s > 0 for s in shares):
        raise ConfigError(f"shares must be positive numbers, one per rank, got {list(shares)!r}")
    whole = float(sum(shares))
    exact = [total * s / whole for s in shares]
    counts = [int(e) for e in exact]
    left = total - sum(counts)
    by_remainder = sorted(range(len(shares)), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in by_remainder[:left]:
        counts[r] += 1
    if total >= len(counts):
        for r, c in enumerate(counts):
            if c == 0:  # one sample from the largest part (ties: the lower rank)
                counts[max(range(len(counts)), key=lambda k: (counts[k], -k))] -= 1
                counts[r] = 1
    return counts


class ShareSampler(torch.utils.data.Sampler[list[int]]):
    """A batch sampler (``DataLoader(dataset, batch_sampler=ShareSampler(...))``): each item is
    this rank's part of one global batch. ``shares``: one positive number per rank (the same
    list as the optimizer's ``batch_shares``); ``rank`` this rank. For the step to be exactly
    the global batch's, the optimizer's shares must be the samples taken:
    :meth:`counts` gives them for each global batch."""

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        shares: Sequence[float],
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if global_batch_size < 1:
            raise ConfigError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0  # samples of this epoch's order already handed out, on every rank
        self.shares: tuple[float, ...] = ()
        self.rank = 0
        self.reset(shares, rank)

    def reset(self, shares: Sequence[float], rank: int) -> None:
        """New shares or a new world (elastic): the rest of the epoch is split by them."""
        if not 0 <= rank < len(shares):
            raise ConfigError(f"rank {rank} has no share in {list(shares)!r} (one per rank)")
        split_counts(self.global_batch_size, shares)  # checks the shares
        self.shares, self.rank = tuple(float(s) for s in shares), rank

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order (when shuffling), from its first sample."""
        self.epoch, self.position = epoch, 0

    def order(self) -> list[int]:
        """The epoch's order of dataset indices, the same on every rank."""
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def counts(self, size: int | None = None) -> list[int]:
        """Every rank's samples in a global batch of ``size`` (default: a full one)."""
        return split_counts(self.global_batch_size if size is None else size, self.shares)

    def record_batch(self) -> None:
        """One global batch was trained on (call after each ``step()``, as ElasticSampler's
        ``record_batch``): a checkpoint taken now resumes after it. A DataLoader reads ahead of
        training, so the position is counted here, not as batches are handed out."""
        self.position = min(self.position + self.global_batch_size, len(self.dataset))

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for at in range(self.position, len(order), self.global_batch_size):
            batch = order[at : at + self.global_batch_size]
            counts = self.counts(len(batch))
            start = sum(counts[: self.rank])
            yield batch[start : start + counts[self.rank]]

    def __len__(self) -> int:
        left = len(self.dataset) - self.position
        return -(-left // self.global_batch_size)

    def state_dict(self) -> dict[str, int]:
        """The position (the same on every rank) and what fixes the epoch's order (the
        dataset's length, the seed, shuffling): a position means nothing in another order."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "length": len(self.dataset),
            "seed": self.seed,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``state``'s position, whatever this sampler's shares, rank and global
        batch size (the rest of the epoch is split by them). A state saved over another order
        (dataset length, seed or shuffling) is refused: it would repeat and skip samples."""
        mine = self.state_dict()
        differ = [
            f"{k} {state[k]} (now {mine[k]})"
            for k in ORDER_FACTS
            if k in state and int(state[k]) != mine[k]
        ]
        if differ:
            raise ConfigError(
                f"the saved ShareSampler position is of another epoch order: {', '.join(differ)}."
                "\nHINT: resume with the dataset, seed and shuffle it was saved with."
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
