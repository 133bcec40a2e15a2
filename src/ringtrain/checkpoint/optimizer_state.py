"""The one adapter between checkpoints and the engine's optimizer: nothing else here touches it.

Saving asks, without any collective, which optimizer state this rank holds:

* a plain ``torch.optim.Optimizer``, or a ``DistributedOptimizer`` that is not sharded: the
  whole state, the same on every rank (:attr:`Held.replicated` is True), from the wrapped
  optimizer's ``state``;
* a sharded ``DistributedOptimizer`` (``shards_state``) after its first step: this rank's
  pieces (:class:`ringtrain.engine.sharded.Piece`: parameter, element range) and their state,
  read from what its step strategy holds (``opt.update.held()``: the shards' ``layouts`` and
  ``optimizers``, one param group per piece in piece order); before its first step the state is
  still whole in the wrapped optimizer;
* a local-update ``DistributedOptimizer`` (``sync_every``): the whole inner state, this rank's
  own, and the step's anchor, outer state and place in the round (:attr:`Held.local`; written by
  :mod:`ringtrain.checkpoint.local_state`).

Loading hands the full per-parameter state to ``opt.load_state_dict`` (torch's format; the
sharded optimizer keeps only its pieces of it, see ``ShardedStep.load_state``), with the
compressor's state under ``COMPRESSOR_STATE_KEY``.

What it uses of the engine is written down as protocols in :mod:`ringtrain.engine.stateful`
(the optimizer, its step strategy's shards, the local-update step), which mypy checks the
engine's classes against; besides them only the keys ``optimizer.COMPRESSOR_STATE_KEY`` and
``local_update.STATE_KEY`` and the ``Piece`` fields ``index``, ``start``, ``stop``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ringtrain.engine.stateful import Checkpointable, LocalState


@dataclass
class PieceState:
    """The state of elements ``[start, stop)`` of parameter ``index`` (flattened)."""

    index: int
    start: int
    stop: int
    elements: dict[str, torch.Tensor]  # per element: 1-D, stop - start long
    scalars: dict[str, object] | None  # per parameter (``step``): set where start == 0


@dataclass
class Held:
    """What this rank holds of the optimizer's state."""

    shapes: list[tuple[int, ...]]  # every parameter's shape, in the optimizer's order
    param_groups: list[dict[str, object]]  # torch's state_dict()["param_groups"]
    replicated: bool  # True: every rank holds the same, whole state
    pieces: list[PieceState] = field(default_factory=list)
    compressor: dict[str, object] | None = None  # {"name", "state"} of a stateful compressor
    local: LocalHeld | None = None  # local updates: every rank's state differs (pieces whole)
    kind: str = ""  # the optimizer's class (kind_of)


@dataclass
class LocalHeld:
    """A local-update step's state (``sync_every``): see :mod:`ringtrain.checkpoint.local_state`."""

    params: list[torch.Tensor]  # its parameters (this rank's weights), in its order
    optim_index: list[int]  # each one's index in the optimizer's parameters
    state: dict[str, Any]  # LocalUpdate.local_state_dict(copy=False): views


def distributed(opt: torch.optim.Optimizer) -> Checkpointable | None:
    """``opt`` as a checkpoint reads a ``DistributedOptimizer``; None for a plain optimizer."""
    from ringtrain.engine.optimizer import DistributedOptimizer

    return opt if isinstance(opt, DistributedOptimizer) else None


def _inner(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    d = distributed(opt)
    return d.optimizer if d is not None else opt


def local_of(opt: torch.optim.Optimizer) -> LocalState | None:
    """The optimizer's local-update step (``sync_every``, :class:`LocalUpdate`), or None."""
    d = distributed(opt)
    return d.local_update if d is not None else None


def params_of(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in _inner(opt).param_groups for p in g["params"]]


def _split(
    st: Mapping[str, object], shape: torch.Size
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Per-element state (a tensor shaped like its parameter, never ``step``, as in torch's own
    ``load_state_dict``) flattened, and per-parameter values."""
    elements, scalars = {}, {}
    for k, v in st.items():
        if k != "step" and isinstance(v, torch.Tensor) and v.shape == shape:
            elements[k] = v.detach().reshape(-1)
        else:
            scalars[k] = v
    return elements, scalars


def held(opt: torch.optim.Optimizer) -> Held:
    """This rank's optimizer state, as views (copy them before the optimizer steps again)."""
    dist_opt = distributed(opt)
    if dist_opt is not None:
        dist_opt.drain()
    inner = _inner(opt)
    params = params_of(opt)
    sd_groups = inner.state_dict()["param_groups"]  # shallow: the state is not copied
    out = Held([tuple(p.shape) for p in params], sd_groups, replicated=True, kind=kind_of(opt))
    if dist_opt is not None:
        comp = dist_opt.compression
        get = getattr(comp, "state_dict", None)
        state = get() if callable(get) else {}
        if state:
            out.compressor = {"name": getattr(comp, "name", type(comp).__name__), "state": state}
    lu = local_of(opt)
    if lu is not None:
        index = {id(p): i for i, p in enumerate(params)}
        out.local = LocalHeld(
            list(lu.params), [index[id(p)] for p in lu.params], lu.local_state_dict(copy=False)
        )
    shards = dist_opt.update.held() if dist_opt is not None and dist_opt.shards_state else None
    whole = {i: inner.state[p] for i, p in enumerate(params) if inner.state.get(p)}
    if shards is None:
        for i, st in whole.items():
            elements, scalars = _split(st, params[i].shape)
            out.pieces.append(PieceState(i, 0, params[i].numel(), elements, scalars))
        return out
    # Sharded: state loaded but not yet absorbed into the shards is whole (and newer) on every
    # rank; this rank writes its own range of it, as if it were sharded.
    out.replicated = False
    optimizers = iter(shards.optimizers)
    for layout in shards.layouts:
        if not layout.pieces:
            continue
        sopt = next(optimizers)
        for piece, group in zip(layout.pieces, sopt.param_groups):
            if piece.index in whole:
                elements, scalars = _split(whole[piece.index], params[piece.index].shape)
                elements = {k: v[piece.start : piece.stop] for k, v in elements.items()}
            else:
                view = group["params"][0]
                elements, scalars = _split(sopt.state.get(view, {}), view.shape)
            out.pieces.append(
                PieceState(
                    piece.index,
                    piece.start,
                    piece.stop,
                    elements,
                    scalars if piece.start == 0 else None,
                )
            )
    return out


def load(
    opt: torch.optim.Optimizer,
    state: dict[int, dict[str, object]],
    param_groups: list[dict[str, object]],
    compressor: dict[str, object] | None,
    local: dict[str, object] | None = None,
) -> None:
    """Load the full per-parameter ``state`` (torch's format) into ``opt``; ``local``: a
    local-update step's state (:meth:`LocalUpdate.local_state_dict`'s format), or None. A
    local-update optimizer given no ``local`` starts afresh from its weights
    (:meth:`LocalUpdate.restart`)."""
    sd: dict[str, object] = {"state": state, "param_groups": param_groups}
    lu = local_of(opt)
    if compressor is not None and distributed(opt) is not None:
        from ringtrain.engine.optimizer import COMPRESSOR_STATE_KEY

        sd[COMPRESSOR_STATE_KEY] = compressor
    if local is not None and lu is not None:
        from ringtrain.engine.local_update import STATE_KEY

        sd[STATE_KEY] = local
    opt.load_state_dict(sd)
    if lu is not None and local is None:
        lu.restart()


def kind_of(opt: torch.optim.Optimizer) -> str:
    """The class of the optimizer that holds the state (the wrapped one of a
    ``DistributedOptimizer``), as ``module.Name``: a checkpoint records it, so that one
    optimizer's state is not loaded into another's."""
    cls = type(_inner(opt))
    return f"{cls.__module__}.{cls.__qualname__}"


def compressor_name(opt: torch.optim.Optimizer) -> str | None:
    d = distributed(opt)
    if d is None:
        return None
    comp = d.compression
    return str(getattr(comp, "name", type(comp).__name__))
