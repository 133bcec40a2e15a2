"""The data position: where each rank was in the epoch, and the rest of the epoch at M ranks.

* :class:`~ringtrain.elastic.ElasticSampler` records the indices each rank processed; the
  union of every saved rank's goes back into it, and its ``reset()`` splits the indices not yet
  processed over the new world.
* torch's ``DistributedSampler`` does not know how far an epoch went, so the caller says how
  many of this rank's indices it consumed: ``save(..., sampler=(sampler, consumed))``. After a
  load, :class:`Remaining` yields this rank's share of the epoch's indices no rank consumed;
  iterate it for the rest of the epoch, then ``sampler.set_epoch(epoch + 1)`` as usual.

In both cases each remaining sample is seen once; when the remaining count does not divide by
the world size, the first few are repeated as padding (fewer than the world size), as both
samplers do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeGuard

import torch
import torch.utils.data

from ringtrain.errors import ConfigError


class _Recording(Protocol):
    """What of an ElasticSampler a checkpoint uses."""

    epoch: int
    processed_indices: set[int]

    def load_state_dict(self, state_dict: dict[str, object]) -> None: ...

    def __iter__(self) -> Iterator[int]: ...


def _records_indices(sampler: object) -> TypeGuard[_Recording]:
    """Whether ``sampler`` keeps the indices it processed, as ElasticSampler does (known by its
    surface: the elastic package is built on this one, so it is not imported here)."""
    return hasattr(sampler, "processed_indices") and callable(
        getattr(sampler, "load_state_dict", None)
    )


def save(sampler: object) -> dict[str, object]:
    consumed = None
    if isinstance(sampler, tuple):
        sampler, consumed = sampler
    if _records_indices(sampler):
        return {
            "kind": "elastic",
            "epoch": sampler.epoch,
            "processed": sorted(sampler.processed_indices),
        }
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        if consumed is None:
            raise ConfigError(
                "a DistributedSampler does not know how far the epoch went.\n"
                "HINT: pass sampler=(sampler, consumed), consumed being how many of this "
                "rank's indices were used this epoch (batches done * batch size)."
            )
        return {
            "kind": "distributed",
            "epoch": sampler.epoch,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "drop_last": sampler.drop_last,
            "num_replicas": sampler.num_replicas,
            "rank": sampler.rank,
            "length": len(sampler.dataset),  # type: ignore[arg-type]
            "consumed": int(consumed),
        }
    raise ConfigError(
        f"cannot save the position of a {type(sampler).__name__}.\n"
        "HINT: use ringtrain.elastic.ElasticSampler, or torch's DistributedSampler as "
        "sampler=(sampler, consumed)."
    )


def _distributed_order(st: dict[str, Any]) -> list[int]:
    """The indices torch's DistributedSampler deals out in ``st``'s epoch, padded as it does."""
    n, replicas = int(st["length"]), int(st["num_replicas"])
    if st["shuffle"]:
        g = torch.Generator()
        g.manual_seed(st["seed"] + st["epoch"])
        order: list[int] = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if st["drop_last"] and n % replicas:
        total = math.ceil((n - replicas) / replicas) * replicas
        return order[:total]
    total = math.ceil(n / replicas) * replicas
    pad = total - n
    return order + (order * math.ceil(pad / max(1, n)))[:pad]


def remaining(states: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """The epoch and its indices not yet consumed, in the epoch's order (every saved rank's
    state in ``states``)."""
    kinds = {s["kind"] for s in states}
    if len(kinds) != 1:
        raise ConfigError(f"the saved ranks used different samplers: {sorted(kinds)}")
    first = states[0]
    if first["kind"] == "elastic":
        done: set[int] = set()
        for s in states:
            done.update(s["processed"])
        return first["epoch"], sorted(done)  # ElasticSampler computes its own order
    order = _distributed_order(first)
    replicas = first["num_replicas"]
    consumed: set[int] = set()
    for s in states:
        mine = order[s["rank"] : len(order) : replicas]
        consumed.update(mine[: s["consumed"]])
    seen: set[int] = set()
    left = []
    for i in order:
        if i not in consumed and i not in seen:
            seen.add(i)
            left.append(i)
    return first["epoch"], left


def restore(sampler: object, states: list[dict[str, Any]], rank: int, size: int) -> Iterable[int]:
    """Put the saved position into ``sampler``; returns what to iterate for the rest of the
    epoch (the sampler itself, or a :class:`Remaining`)."""
    if isinstance(sampler, tuple):
        sampler = sampler[0]
    epoch, indices = remaining(states)
    if states[0]["kind"] == "elastic":
        if not _records_indices(sampler):
            raise ConfigError(
                f"the checkpoint holds an ElasticSampler's position, got {type(sampler).__name__}"
            )
        sampler.load_state_dict({"epoch": epoch, "processed_indices": set(indices)})
        return sampler
    if not isinstance(sampler, torch.utils.data.DistributedSampler):
        raise ConfigError(
            f"the checkpoint holds a DistributedSampler's position, got {type(sampler).__name__}"
        )
    sampler.set_epoch(epoch)
    return Remaining(indices, rank, size, epoch)


class Remaining(torch.utils.data.Sampler[int]):
    """This rank's share of the indices an epoch has left (every ``size``-th, padded)."""

    def __init__(self, indices: list[int], rank: int, size: int, epoch: int) -> None:
        self.epoch = epoch
        per = math.ceil(len(indices) / size) if indices else 0
        padded = indices + indices[: per * size - len(indices)]
        self.indices = padded[rank : per * size : size]

    def __iter__(self) -> Iterator[int]:
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)
