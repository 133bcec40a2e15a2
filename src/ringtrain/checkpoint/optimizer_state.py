"""The one adapter between checkpoints and the engine's optimizer: nothing else here touches it.

Saving asks, without any collective, which optimizer state this rank holds:

* a plain ``torch.optim.Optimizer``, or a ``DistributedOptimizer`` that is not sharded: the
  whole state, the same on every rank (:attr:`Held.replicated` is True), from the wrapped
  optimizer's ``state``;
* a sharded ``DistributedOptimizer`` (``shards_state``) after its first step: this rank's
  pieces (:class:`ringtrain.engine.sharded.Piece`: parameter, element range) and their state,
  read from what its step strategy holds (``opt.update.held()``: the shards' ``layouts`` and
  ``optimizers``, one param group per piece in piece order); before its first step the state is
  still whole in the wrapped optimizer.

Loading hands the full per-parameter state to ``opt.load_state_dict`` (torch's format; the
sharded optimizer keeps only its pieces of it, see ``ShardedStep.load_state``), with the
compressor's state under ``COMPRESSOR_STATE_KEY``.

What it uses of the engine, all public, so the engine can change under it:
``DistributedOptimizer``: ``optimizer`` (the wrapped one), ``shards_state``, ``compression``,
``drain()`` (finish an overlapped step's pending updates), ``update.held()`` (the step
strategy's share of the state: :class:`ringtrain.engine.steps.Update`), ``load_state_dict``;
``ShardedStep``: ``layouts``, ``optimizers``; ``Piece``: ``index``, ``start``, ``stop``;
``optimizer.COMPRESSOR_STATE_KEY``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ringtrain.errors import ConfigError


@dataclass
class PieceState:
    """The state of elements ``[start, stop)`` of parameter ``index`` (flattened)."""

    index: int
    start: int
    stop: int
    elements: dict[str, torch.Tensor]  # per element: 1-D, stop - start long
    scalars: dict[str, Any] | None  # per parameter (``step``): set where start == 0


@dataclass
class Held:
    """What this rank holds of the optimizer's state."""

    shapes: list[tuple[int, ...]]  # every parameter's shape, in the optimizer's order
    param_groups: list[dict[str, Any]]  # torch's state_dict()["param_groups"]
    replicated: bool  # True: every rank holds the same, whole state
    pieces: list[PieceState] = field(default_factory=list)
    compressor: dict[str, Any] | None = None  # {"name", "state"} of a stateful compressor


def _is_distributed(opt: Any) -> bool:
    from ringtrain.engine.optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def refuse_local_updates(opt: Any) -> None:
    """Local updates (``sync_every`` set) are not checkpointed yet: between outer steps every
    rank's inner optimizer state differs, and the anchor, outer momentum and error feedback are
    kept beside it; saving one replicated copy would resume to other weights, so it is refused."""
    if _is_distributed(opt) and opt.local_update is not None:
        raise ConfigError(
            "ringtrain.checkpoint cannot save or load a local-update optimizer (sync_every set) "
            "yet: each rank's inner state differs between outer steps.\n"
            "HINT: save each rank's opt.state_dict() (it holds the anchor, outer state and "
            "error feedback) with torch.save, one file per rank, and load it at the same world "
            "size; or train without sync_every."
        )


def params_of(opt: Any) -> list[torch.Tensor]:
    inner = opt.optimizer if _is_distributed(opt) else opt
    return [p for g in inner.param_groups for p in g["params"]]


def _split(st: dict[str, Any], shape: torch.Size) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Per-element state (a tensor shaped like its parameter, never ``step``, as in torch's own
    ``load_state_dict``) flattened, and per-parameter values."""
    elements, scalars = {}, {}
    for k, v in st.items():
        if k != "step" and isinstance(v, torch.Tensor) and v.shape == shape:
            elements[k] = v.detach().reshape(-1)
        else:
            scalars[k] = v
    return elements, scalars


def held(opt: Any) -> Held:
    """This rank's optimizer state, as views (copy them before the optimizer steps again)."""
    refuse_local_updates(opt)
    dist_opt = _is_distributed(opt)
    if dist_opt:
        opt.drain()
    inner = opt.optimizer if dist_opt else opt
    params = params_of(opt)
    sd_groups = inner.state_dict()["param_groups"]  # shallow: the state is not copied
    out = Held([tuple(p.shape) for p in params], sd_groups, replicated=True)
    if dist_opt:
        comp = opt.compression
        get = getattr(comp, "state_dict", None)
        state = get() if callable(get) else {}
        if state:
            out.compressor = {"name": getattr(comp, "name", type(comp).__name__), "state": state}
    shards = opt.update.held() if dist_opt and opt.shards_state else None
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
    opt: Any,
    state: dict[int, dict[str, Any]],
    param_groups: list[dict[str, Any]],
    compressor: dict[str, Any] | None,
) -> None:
    """Load the full per-parameter ``state`` (torch's format) into ``opt``."""
    refuse_local_updates(opt)
    sd: dict[str, Any] = {"state": state, "param_groups": param_groups}
    if compressor is not None and _is_distributed(opt):
        from ringtrain.engine.optimizer import COMPRESSOR_STATE_KEY

        sd[COMPRESSOR_STATE_KEY] = compressor
    opt.load_state_dict(sd)


def compressor_name(opt: Any) -> str | None:
    if not _is_distributed(opt):
        return None
    comp = opt.compression
    return str(getattr(comp, "name", type(comp).__name__))
