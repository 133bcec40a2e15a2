"""ElasticSampler: splits a dataset over the ranks and resumes an epoch after the world changed.

It tracks the dataset indices processed this epoch (``record_batch``/``record_indices``). Held by
a :class:`~ringtrain.elastic.TorchState`, each commit stores the union of every rank's processed
indices; after a reset the indices not yet processed are split over the new world, so each
sample of the epoch is trained on exactly once across any number of membership changes.

Limit (as Horovod and ``DistributedSampler``): every rank must take the same number of batches,
so when the remaining indices do not divide by the world size, the first few are repeated as
padding (fewer than the world size per reset). Choose sizes that divide to avoid it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch.utils.data

from ringtrain.runtime import state as runtime


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)``.

    Call :meth:`record_batch` after each batch and :meth:`set_epoch` at the END of each epoch
    (it clears the processed indices). ``num_replicas``/``rank`` pin the split (tests); by
    default each :meth:`reset` reads them from the running job.
    """

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool = True,
        seed: int = 0,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self._pinned = (num_replicas, rank)
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: a new order (when shuffling) and no index processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Record this rank's batch ``batch_idx`` (of ``batch_size``) of the current pass."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Record dataset indices this rank has processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    @property
    def processed_num(self) -> int:
        """How many of this epoch's indices have been processed (Horovod's count)."""
        return len(self.processed_indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes ringtrain's state or Horovod's, whose ``processed_num`` counts the first
        indices of the epoch's order (its ranks take them in order, all at the same pace)."""
        self.epoch = int(state_dict["epoch"])
        if "processed_indices" in state_dict:
            self.processed_indices = set(state_dict["processed_indices"])
        else:
            self.processed_indices = set(self._order()[: int(state_dict["processed_num"])])
        self.reset()

    def reset(self) -> None:
        """Split the indices not yet processed over the world as it is now."""
        replicas, rank = self._pinned
        if replicas is None or rank is None:
            rt = runtime.current() if runtime.is_initialized() else None
            replicas = rt.size if rt is not None else 1
            rank = rt.rank if rt is not None else 0
        self.num_replicas, self.rank = replicas, rank
        self.remaining_indices = [i for i in self._order() if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = (
            self.remaining_indices
            + self.remaining_indices[: self.total_size - len(self.remaining_indices)]
        )
        self.indices = padded[self.rank : self.total_size : self.num_replicas]

    def _order(self) -> list[int]:
        """This epoch's order of the dataset's indices, the same on every rank."""
        order = list(range(len(self.dataset)))
        if self.shuffle:  # seeded by seed and epoch only
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples
