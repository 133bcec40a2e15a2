"""Make every rank start from the same model and optimizer state.

``broadcast_parameters`` overwrites tensors in place from the root. ``broadcast_optimizer_state``
sends the root's ``state_dict`` as a skeleton (an object broadcast) plus its tensors (tensor
broadcasts), so ranks whose optimizer has not stepped yet, and so has no state, still receive it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from ringtrain.collectives import objects, ops
from ringtrain.collectives.objects import allgather_object, broadcast_object
from ringtrain.engine import overlap
from ringtrain.errors import CollectiveArgumentError, by_rank
from ringtrain.runtime.process_sets import ProcessSet

_EXPECTS = (
    "broadcast_parameters expects model.state_dict(), list(model.named_parameters()) or a list "
    "of tensors"
)


def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, list):
        items = list(params)
        if items and isinstance(items[0], torch.Tensor):
            items = [(f"param.{i}", t) for i, t in enumerate(items)]
    else:  # Horovod's: ValueError('invalid params of type ...') for all but a dict or a list
        raise CollectiveArgumentError(
            f"{_EXPECTS}, got {type(params).__name__}, as Horovod's refuses anything but a dict "
            "or a list.\nHINT: pass list(model.named_parameters()), list(model.parameters()) or "
            "model.state_dict()."
        )
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise CollectiveArgumentError(
                f"{_EXPECTS}; its item {i} is of type {type(item).__name__}, not a (name, tensor) pair"
            )
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise CollectiveArgumentError(
                f"broadcast_parameters: {name!r} is a {type(t).__name__}, not a tensor"
            )
    return items


def broadcast_parameters(
    params: Any,
    root_rank: int = 0,
    process_set: ProcessSet | None = None,
    prefix: str = "broadcast.param",
) -> None:
    """Overwrite ``params`` (a state_dict, named_parameters() or tensors) with the root's, in place.

    The ranks first agree that they hold the same names (one small allgather): where they do
    not, every rank raises, naming what differs. Horovod's ranks would wait forever for the
    broadcasts that the others never submit.

    Pending updates of overlapped optimizers (``overlap=True``) end first, as Horovod's ``step()``
    returns with the parameters updated: a broadcast racing them sends stale values from the
    root and is overwritten by the update elsewhere, and the ranks part."""
    named = _named(params)
    overlap.drain_all()
    _same_names([name for name, _ in named], prefix, process_set)
    handles = []
    with torch.no_grad():
        for name, t in named:
            data = t.data if isinstance(t, torch.nn.Parameter) else t
            # Collectives take contiguous tensors only (as Horovod's); a channels_last model's
            # weights are not, so they travel in a contiguous copy and are written back.
            sent = data.contiguous()
            handles.append(
                (data, sent, ops.broadcast_async_(sent, root_rank, f"{prefix}.{name}", process_set))
            )
    for data, sent, h in handles:
        ops.synchronize(h)
        if sent is not data:
            with torch.no_grad():
                data.copy_(sent)


def _same_names(names: list[str], prefix: str, process_set: ProcessSet | None) -> None:
    """Raise on every rank unless every rank of ``process_set`` holds exactly ``names``."""
    digest = hashlib.blake2b("\n".join(sorted(names)).encode(), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    every = ops.synchronize(ops.allgather_async(mine, f"{prefix}.names", process_set)).tolist()
    if len(set(every)) == 1:
        return
    lists = allgather_object(sorted(names), f"{prefix}.names.lists", process_set)
    ranks = ops.controller_of(process_set).comm.ranks
    common = set.intersection(*(set(n) for n in lists))
    lines = [
        f"  rank {r}: {len(n)} tensors; only here: {_few(sorted(set(n) - common))}"
        for r, n in zip(ranks, lists)
    ]
    raise CollectiveArgumentError(
        "broadcast_parameters: the ranks hold different tensors (by name):\n"
        + "\n".join(lines)
        + "\nHINT: build the same model on every rank before broadcasting its state_dict(); "
        "a layer added on some ranks only, or a branch taken on some, does this."
    )


def _few(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most]) or "none"
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


class _TensorSlot:
    """Stands for the i-th tensor of a state_dict while its skeleton travels as an object."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


def _init_state(inner: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """An optimizer with no state yet: zero gradients on the trainable parameters and one step
    of the plain optimizer (never the distributed one, whose step would reduce), as Horovod
    does. Like Horovod, this leaves those gradients at zero; they are sparse for SparseAdam and
    for SGD on the parameters of ``model``'s sparse embeddings, which take no dense gradient."""
    if inner.state_dict()["state"]:
        return
    sparse = _sparse_parameters(model)
    for group in inner.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(inner, torch.optim.SparseAdam) or (
                    isinstance(inner, torch.optim.SGD) and id(p) in sparse
                ):
                    p.grad = p.grad.to_sparse()
    inner.step()


def _sparse_parameters(model: torch.nn.Module | None) -> set[int]:
    if model is None:
        return set()
    return {
        id(p)
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.sparse
        for p in m.parameters()
    }


def _parameters(inner: torch.optim.Optimizer) -> list[list[tuple[int, ...]]]:
    """The shapes of the optimizer's parameters, group by group: what its state is laid on."""
    return [[tuple(p.shape) for p in group["params"]] for group in inner.param_groups]


def _stateless(
    stateful: bool, shapes: list[list[tuple[int, ...]]], process_set: ProcessSet | None
) -> bool:
    """Whether the optimizer has no state on any rank (Horovod then sends nothing). Asked of
    every rank, with a digest of its parameters' shapes: where Horovod would hang (the stateful
    ranks broadcasting to ranks that left) or fail on some ranks only (a root's state loaded
    onto other parameters), every rank raises, naming what differs."""
    ctl = ops.controller_of(process_set)
    digest = hashlib.blake2b(repr(shapes).encode(), digest_size=8).digest()
    mine = [int(stateful), int.from_bytes(digest, "little", signed=True)]
    gathered = ops.synchronize(
        ops.allgather_async(
            torch.tensor([mine], dtype=torch.int64),
            "broadcast.optimizer_state.stateful",
            process_set,
        )
    )
    rows = gathered.tolist()
    has = [row[0] for row in rows]
    if len({row[1] for row in rows}) > 1:
        _different_parameters(shapes, process_set)
    if all(has) or not any(has):
        return not any(has)
    ranks = ctl.comm.ranks
    with_state = [r for r, h in zip(ranks, has) if h]
    without = [r for r, h in zip(ranks, has) if not h]
    raise CollectiveArgumentError(
        f"broadcast_optimizer_state: the optimizer has state on ranks {with_state} and none on "
        f"ranks {without}, even after a step on zero gradients (a stateless optimizer there: "
        "SGD without momentum, say).\n"
        "HINT: build the same optimizer, with the same options, on every rank."
    )


def _different_parameters(
    shapes: list[list[tuple[int, ...]]], process_set: ProcessSet | None
) -> None:
    """Raise on every rank, each rank's parameters told (they differ on some rank)."""
    every = allgather_object(shapes, "broadcast.optimizer_state.shapes", process_set)
    layouts = [
        f"{sum(len(g) for g in groups)} parameters in {len(groups)} group(s): "
        + "; ".join(
            f"group {g}: " + _few([str(list(s)) for s in group]) for g, group in enumerate(groups)
        )
        for groups in every
    ]
    lines = by_rank(layouts, ops.controller_of(process_set).comm.ranks)
    raise CollectiveArgumentError(
        "broadcast_optimizer_state: the optimizers hold different parameters (by shape):\n"
        + "\n".join(lines)
        + "\nHINT: build the same model and optimizer (the same parameter groups) on every "
        "rank before broadcasting the optimizer's state."
    )


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int = 0,
    model: torch.nn.Module | None = None,
    process_set: ProcessSet | None = None,
) -> None:
    """Replace every rank's optimizer state (and hyper-parameters) with the root's.

    A fresh optimizer first takes one step on zero gradients (Horovod's way), so its state
    exists (e.g. Adam's ``step`` and moments) and has the same structure on every rank.
    ``model`` (Horovod's third argument) marks its sparse embeddings' parameters. An optimizer
    that still has no state after that step (SGD without momentum) is stateless: nothing is
    sent and each rank keeps its own hyper-parameters, as in Horovod."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not hasattr(inner, "param_groups"):
        raise CollectiveArgumentError(
            "broadcast_optimizer_state expects an optimizer (a torch.optim.Optimizer or a "
            f"DistributedOptimizer), got {type(optimizer).__name__}.\n"
            "HINT: a model's weights go with broadcast_parameters(model.state_dict(), root_rank)."
        )
    if isinstance(inner, torch.optim.LBFGS):
        raise CollectiveArgumentError(
            "cannot broadcast torch.optim.LBFGS state (as in Horovod).\n"
            "HINT: broadcast the parameters with broadcast_parameters() instead."
        )
    # A sharded DistributedOptimizer (shard_optimizer=True) gathers and loads its full state
    # itself; its state_dict() is collective, so every rank takes it.
    owner: Any = optimizer if getattr(optimizer, "shards_state", False) else inner
    state = owner.state_dict()
    if not state["state"]:
        _init_state(inner, model)
        state = owner.state_dict()
    if _stateless(bool(state["state"]), _parameters(inner), process_set):
        return
    state.pop("ringtrain_compressor", None)  # per-rank (error feedback): never the root's
    me = ops.controller_of(process_set).comm.world_rank  # root_rank is global, as in Horovod
    tensors: list[torch.Tensor] = []
    skeleton = _split(state, tensors) if me == root_rank else None
    skeleton = broadcast_object(
        skeleton, root_rank, "broadcast.optimizer_state.skeleton", process_set
    )
    slots: list[_TensorSlot] = []

    def collect(o: Any) -> None:
        if isinstance(o, _TensorSlot):
            slots.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(skeleton)
    slots.sort(key=lambda s: s.index)
    if me != root_rank:
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
    tensors = [t.contiguous() for t in tensors]  # the root's may not be (channels_last)
    handles = [
        ops.broadcast_async_(t, root_rank, f"broadcast.optimizer_state.{i}", process_set)
        for i, t in enumerate(tensors)
    ]
    for h in handles:
        ops.synchronize(h)
    if me != root_rank:
        owner.load_state_dict(_fill(skeleton, tensors))


def join(device: int = -1, process_set: ProcessSet | None = None) -> int:
    """:func:`ringtrain.collectives.objects.join` (Horovod's), once this rank's overlapped
    updates (``overlap=True``) have ended, as Horovod's ``step()`` returns with the update done.
    A rank whose last step still waited in the updater joined at once: its peer, one step
    short, joined too, and the job ended with that update missing, not with join()'s error that
    it does not stand in for ``step()`` (the peer now sees this rank wait in that step)."""
    overlap.drain_all()
    return objects.join(device, process_set)
