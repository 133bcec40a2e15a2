"""What each rank writes (the cut), and how the parts of N ranks are put back together at M.

Keys (DCP's fully qualified names; the first dot separates the section):

* ``model.<name>``: each tensor of ``model.state_dict()`` whole, written by one rank: the
  tensors are dealt largest first to the rank with the fewest bytes so far (a pure function
  of the names and sizes, so every rank computes the same cut).
* ``optim.<i>.<key>``: the per-element state of parameter ``i`` (the wrapped optimizer's
  order), flattened to 1-D; each rank writes the chunks it holds: its ZeRO-1 pieces when the
  optimizer is sharded, else whole parameters dealt like the model's tensors.
  ``optim_scalar.<i>.<key>``: per-parameter values (``step``), from the rank holding element 0.
  ``meta.optim``: param groups, shapes and the optimizer's class (rank 0).
* ``rank<r>.rng``, ``rank<r>.sampler``, ``rank<r>.compressor``: each rank's own.
* ``meta.extra``: the ``extra`` object (rank 0; it must be the same on every rank).

Loading reads every part (each rank needs the whole model, and the optimizer state is
re-split by the optimizer at the new world size), checks each tensor is covered exactly by its
chunks, and only then applies anything.
"""

from __future__ import annotations

import pickle
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from ringtrain.checkpoint import local_state, optimizer_state
from ringtrain.checkpoint.layout import Item
from ringtrain.errors import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex


def deal(sizes: Mapping[str, int], ranks: int) -> dict[str, int]:
    """Each key to one rank, largest first to the least loaded (ties: lowest rank, then key)."""
    load = [0] * ranks
    out = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(ranks), key=lambda j: (load[j], j))
        out[key] = r
        load[r] += sizes[key]
    return out


def _host(t: torch.Tensor) -> torch.Tensor:
    """A private host copy: its own storage (``torch.save`` of a view would write the base)."""
    return t.detach().to("cpu", copy=True).contiguous()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def rng_state() -> dict[str, object]:
    state: dict[str, object] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def snapshot(
    rank: int,
    size: int,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: object = None,
    extra: object = None,
    host: Callable[[torch.Tensor, str], object] | None = None,
) -> tuple[list[Item], dict[str, object]]:
    """This rank's items, copied to host memory (by ``host(tensor, key)``: default a fresh
    copy), and the layout facts for the manifest."""
    from ringtrain.checkpoint import samplers

    copy = host if host is not None else (lambda t, key: _host(t))
    items: list[Item] = []
    layout: dict[str, object] = {"world_size": size}
    model_sd = model.state_dict() if model is not None else {}
    tensors = {k: v for k, v in model_sd.items() if isinstance(v, torch.Tensor)}
    sizes = {f"model.{k}": _nbytes(v) for k, v in tensors.items()}
    held = optimizer_state.held(optimizer) if optimizer is not None else None
    local = None
    if held is not None and held.local is not None:
        local = local_state.cut(rank, model, tensors, held)
        tensors = local.model  # the parameters as the anchor
        shared = {**{f"model.{k}": v for k, v in tensors.items()}, **local.shared}
        sizes.update({k: _nbytes(v) for k, v in local.shared.items()})
    else:
        shared = {f"model.{k}": v for k, v in tensors.items()}
    if held is not None and held.replicated and local is None:
        for piece in held.pieces:
            for key, v in piece.elements.items():
                sizes[f"optim.{piece.index}.{key}"] = _nbytes(v)
    owner = deal(sizes, size)
    for k, v in shared.items():
        if owner[k] == rank:
            items.append(Item(k, copy(v, k), tuple(v.shape), (0,) * v.dim()))
    others = {k: v for k, v in model_sd.items() if not isinstance(v, torch.Tensor)}
    if model is not None and rank == 0:
        items.append(Item("meta.model", {"keys": list(model_sd), "objects": others}))
    if local is not None:
        assert held is not None
        layout["optimizer"] = "local"
        layout["sync_every"] = local.meta["sync_every"]
        for fqn, v, as_tensor in local.own:
            if as_tensor:
                items.append(Item(fqn, copy(v, fqn), tuple(v.shape), (0,) * v.dim()))
            else:
                items.append(Item(fqn, _to_host(v)))
        if rank == 0:
            items.append(Item("meta.local", _to_host(local.meta)))
    if held is not None:
        assert optimizer is not None  # held is the optimizer's
        layout.setdefault("optimizer", "sharded" if not held.replicated else "whole")
        layout["compressor"] = optimizer_state.compressor_name(optimizer)
        for piece in held.pieces if local is None else []:
            numel = 1
            for d in held.shapes[piece.index]:
                numel *= d
            for key, v in piece.elements.items():
                fqn = f"optim.{piece.index}.{key}"
                if held.replicated and owner[fqn] != rank:
                    continue
                items.append(Item(fqn, copy(v, f"{fqn}@{piece.start}"), (numel,), (piece.start,)))
            if piece.scalars is not None and (not held.replicated or _first(owner, piece, rank)):
                for key, scalar in piece.scalars.items():
                    value = _host(scalar) if isinstance(scalar, torch.Tensor) else scalar
                    items.append(Item(f"optim_scalar.{piece.index}.{key}", value))
        if rank == 0:
            meta = {"param_groups": held.param_groups, "shapes": held.shapes, "kind": held.kind}
            items.append(Item("meta.optim", meta))
        if held.compressor is not None:
            comp = _to_host(held.compressor)
            items.append(Item(f"rank{rank}.compressor", comp))
    items.append(Item(f"rank{rank}.rng", rng_state()))
    if sampler is not None:
        items.append(Item(f"rank{rank}.sampler", samplers.save(sampler)))
    items += _extra(extra, rank)
    return items, layout


def _extra(extra: object, rank: int) -> list[Item]:
    """``extra``, written by rank 0 and checked on every rank: an error on rank 0 alone, while
    writing, would leave the others waiting for its word on the save."""
    if extra is None:
        return []
    try:
        pickle.dumps(extra)
    except Exception as e:  # PicklingError, or TypeError/AttributeError naming what could not go
        raise CheckpointError(
            f"extra cannot be saved: it must be picklable, and pickle says {type(e).__name__}: "
            f"{e}.\nHINT: keep plain data in extra (numbers, strings, lists, dicts, tensors), "
            "not lambdas, local functions, locks or open files. Nothing was written."
        ) from e
    return [Item("meta.extra", extra)] if rank == 0 else []


def _first(owner: dict[str, int], piece: optimizer_state.PieceState, rank: int) -> bool:
    """Replicated state: a parameter's per-parameter values go with its first per-element key
    (to rank 0 for a parameter without per-element state)."""
    keys = sorted(piece.elements)
    return owner[f"optim.{piece.index}.{keys[0]}"] == rank if keys else rank == 0


def _to_host(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return _host(obj)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_host(v) for v in obj)
    return obj


@dataclass
class Assembled:
    """Every key of a checkpoint put back together (tensors whole)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)


def assemble(
    metadata: Metadata,
    read: Callable[[MetadataIndex], object],
    where: str,
    wanted: set[str] | None = None,
) -> Assembled:
    """Rebuild whole tensors from their chunks. ``read(index)`` returns one stored item;
    a tensor not covered exactly by its chunks is an error naming the checkpoint."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    out = Assembled()
    for fqn, md in metadata.state_dict_metadata.items():
        if wanted is not None and fqn.split(".", 1)[0] not in wanted:
            continue
        if not isinstance(md, TensorStorageMetadata):
            out.objects[fqn] = read(MetadataIndex(fqn))
            continue
        whole = torch.empty(md.size, dtype=md.properties.dtype)
        covered = 0
        for chunk in md.chunks:
            part = cast(torch.Tensor, read(MetadataIndex(fqn, chunk.offsets)))
            if tuple(part.shape) != tuple(chunk.sizes):
                raise CheckpointError(
                    f"{where}: chunk {tuple(chunk.offsets)} of {fqn} has shape "
                    f"{tuple(part.shape)}, the metadata says {tuple(chunk.sizes)}.\n"
                    "HINT: the checkpoint is damaged; load an earlier one."
                )
            view = whole
            for dim, (o, n) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, o, n)
            view.copy_(part)
            covered += part.numel()
        if covered != whole.numel():
            raise CheckpointError(
                f"{where}: {fqn} has {covered} of its {whole.numel()} elements: a shard is "
                "missing.\nHINT: the checkpoint is incomplete; load an earlier one."
            )
        out.tensors[fqn] = whole
    return out
