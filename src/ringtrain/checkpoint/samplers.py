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

* :class:`~ringtrain.elastic.share_sampler.ShareSampler` (``batch_shares``) is at the same
  position on every rank: the samples of the epoch's order already trained on, a prefix. It is
  saved once per rank as its ``state_dict()`` (the ranks must agree) and loaded back into the
  sampler, which keeps its own shares, rank and global batch size: the rest of the epoch is
  split by those in force after the resume, each sample once, with no padding.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeGuard

import torch
import torch.utils.data

from ringtrain.errors import CheckpointError, ConfigError


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


class _SharesBatches(Protocol):
    """What of a ShareSampler a checkpoint uses."""

    shares: tuple[float, ...]
    global_batch_size: int

    def state_dict(self) -> dict[str, int]: ...

    def load_state_dict(self, state: dict[str, int]) -> None: ...

    def __iter__(self) -> Iterator[list[int]]: ...


def _shares_batches(sampler: object) -> TypeGuard[_SharesBatches]:
    """Whether ``sampler`` is a ShareSampler (known by its surface, as above)."""
    return (
        hasattr(sampler, "shares")
        and hasattr(sampler, "global_batch_size")
        and callable(getattr(sampler, "load_state_dict", None))
    )


def save(sampler: object) -> dict[str, object]:
    consumed = None
    if isinstance(sampler, tuple):
        sampler, consumed = sampler
    if _shares_batches(sampler):
        return {
            "kind": "share",
            "state": sampler.state_dict(),
            "shares": list(sampler.shares),  # for the record: a resume keeps its own
            "global_batch_size": sampler.global_batch_size,
        }
    if _records_indices(sampler):
        return {
            "kind": "elastic",
            "epoch": sampler.epoch,
            "processed": sorted(sampler.processed_indices),
        }
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        if consumed is None or not hasattr(consumed, "__index__"):  # an int, numpy's too
            said = "" if consumed is None else f" (consumed was a {type(consumed).__name__})"
            raise ConfigError(
                f"a DistributedSampler does not know how far the epoch went{said}.\n"
                "HINT: pass sampler=(sampler, consumed), consumed being how many of this "
                "rank's indices were used this epoch, a number (batches done * batch size)."
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
            "consumed": operator.index(consumed),
        }
    raise ConfigError(
        f"cannot save the position of a {type(sampler).__name__}.\n"
        "HINT: use ringtrain.elastic.ElasticSampler, ringtrain.elastic.share_sampler."
        "ShareSampler, or torch's DistributedSampler as sampler=(sampler, consumed)."
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


def shared_position(states: list[dict[str, Any]]) -> dict[str, int]:
    """The one position every saved rank's ShareSampler held; ranks that disagree recorded
    different batches, and no position would give every sample once."""
    first = states[0]["state"]
    for r, s in enumerate(states):
        if s["state"] != first:
            raise CheckpointError(
                f"the saved ranks' ShareSampler positions differ: rank 0 {first}, rank {r} "
                f"{s['state']}.\nHINT: call record_batch() once after every step on every rank."
            )
    return dict(first)


def remaining(states: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """The epoch and its indices not yet consumed, in the epoch's order (every saved rank's
    state in ``states``)."""
    kinds = {s["kind"] for s in states}
    if len(kinds) != 1:
        raise ConfigError(f"the saved ranks used different samplers: {sorted(kinds)}")
    first = states[0]
    if first["kind"] == "share":
        raise ConfigError("a ShareSampler's rest of the epoch is the sampler: use restore()")
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


def restore(
    sampler: object, states: list[dict[str, Any]], rank: int, size: int
) -> Iterable[int] | Iterable[list[int]]:
    """Put the saved position into ``sampler``; returns what to iterate for the rest of the
    epoch (the sampler itself, or a :class:`Remaining`)."""
    if isinstance(sampler, tuple):
        sampler = sampler[0]
    if {s["kind"] for s in states} == {"share"}:
        if not _shares_batches(sampler):
            raise ConfigError(
                f"the checkpoint holds a ShareSampler's position, got {type(sampler).__name__}"
            )
        sampler.load_state_dict(shared_position(states))
        return sampler
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
