"""A local-update optimizer (``sync_every``) in a checkpoint: the shared state once, each rank's own.

Between outer steps every rank's weights and inner optimizer state differ; the anchor (the
weights of the last outer step) and the outer optimizer's state are the same on every rank once
an outer step agreed them. So the cut (``i``: the local-update step's parameter order,
:attr:`LocalUpdate.params`):

Shared, each tensor written by one rank (dealt with the model's tensors, largest first):

* the anchor: as ``model.<name>`` when the model is saved (the checkpoint's model is then the
  weights every rank agrees on, and torch's tools read that), else ``local.anchor.<i>``;
* ``local.outer.<j>.<key>``: the outer optimizer's tensors (Nesterov momentum);
* ``local.pending.<f>``: fragment ``f``'s overlapped exchange's average, waited for (the same
  on every rank; ``outer_fragments``, :mod:`ringtrain.engine.outer_fragment`; the whole
  model's ``local.pending`` in files written before fragments);
* ``meta.local`` (rank 0): ``sync_every``, the number of fragments, the outer step count, where
  the anchor lies, the outer optimizer's param groups and plain values, the parameters' shapes.

Per rank ``r`` (``rank<r>.``): ``local.param.<i>`` its weights where they differ from the anchor
(mid-round), ``optim.<i>.<key>`` / ``optim_scalar.<i>.<key>`` its inner optimizer's state (whole),
``local.residual.<f>`` fragment ``f``'s error feedback (``local.residual``: the whole model's,
before fragments), ``local.base.<i>`` (overlapped, its fragment's exchange in flight) its weights
when it sent (``local.ref.<i>`` in files written before the delay),
``model.<name>`` its buffers (not exchanged by local updates), and ``local``: its place in
the round, the outer exchange the defaults chose (``outer_choice``; a load at the saved size
takes it) and, while the ranks do not yet agree (before the first outer step, after a load or a
re-forming), its own anchor (``local.anchor.<i>``) and outer state.

Loading (:func:`apply`): at the saved world size into a local-update optimizer, every rank gets
its own state back, bit for bit. Anywhere else every rank resumes from the anchor (see
:func:`describe_reset` and docs/checkpoint.md for the rule).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ringtrain.checkpoint import optimizer_state
from ringtrain.errors import CheckpointError

log = logging.getLogger("ringtrain")


@dataclass
class Cut:
    """What a rank of a local-update job writes (see the module docstring)."""

    model: dict[str, torch.Tensor]  # the model's tensors to deal, parameters as the anchor
    shared: dict[str, torch.Tensor]  # local.* tensors to deal with them
    # rank<r>.*: (key, value, whether it is stored as a tensor, else as a pickled object)
    own: list[tuple[str, Any, bool]] = field(default_factory=list)
    meta: dict[str, object] = field(default_factory=dict)  # meta.local


def cut(
    rank: int,
    model: torch.nn.Module | None,
    tensors: dict[str, torch.Tensor],
    held: optimizer_state.Held,
) -> Cut:
    """This rank's share of a local-update optimizer's state (views; the caller copies)."""
    local = held.local
    assert local is not None  # the caller cuts only a local-update optimizer's state
    st = local.state
    anchor: list[torch.Tensor] | None = st["anchor"]
    agreed = bool(st["agreed"])
    out = Cut(dict(tensors), {})
    # The anchor goes where the model keeps the parameter (under every name it has there), once;
    # the rest under local.anchor.<i>.
    names: dict[int, list[str]] = {}
    buffers: set[str] = set()
    if model is not None:
        by_id = {id(p): i for i, p in enumerate(local.params)}
        for name, v in model.state_dict(keep_vars=True).items():
            i = by_id.get(id(v))
            if i is not None and name in tensors:
                names.setdefault(i, []).append(name)
        buffers = {n for n, _ in model.named_buffers()} & set(tensors)
    where: list[str] = []
    for i, a in enumerate(anchor or []):
        if i in names:
            where.append(f"model.{names[i][0]}")
            for name in names[i]:
                out.model[name] = a
        else:
            where.append(f"local.anchor.{i}")
            out.shared[where[-1]] = a
    mine = f"rank{rank}."
    flight = st["overlap"]
    base = flight["base"] or []
    residuals = st["codec"]["residual"]
    own: dict[str, Any] = {
        "inner_steps": st["inner_steps"],
        "codec": st["codec"]["name"],
        "params": [],
        "bases": [i for i, b in enumerate(base) if b is not None],
        "since_sent": flight["since_sent"],
        "residuals": [f for f, r in enumerate(residuals) if r is not None],
        "outer": None,
        "outer_choice": st.get("outer_choice"),  # what the defaults chose (a load takes it)
    }
    for i, p in enumerate(local.params):
        if anchor is None or not torch.equal(p.detach(), anchor[i]):
            own["params"].append(i)
            out.own.append((f"{mine}local.param.{i}", p.detach(), True))
    if not agreed:
        own["outer"] = st["outer"]
        for i, a in enumerate(anchor or []):
            out.own.append((f"{mine}local.anchor.{i}", a, True))
    for i in own["bases"]:
        out.own.append((f"{mine}local.base.{i}", base[i], True))
    for f in own["residuals"]:
        out.own.append((f"{mine}local.residual.{f}", residuals[f], True))
    for name in sorted(buffers):  # buffers: only names in tensors
        out.own.append((f"{mine}model.{name}", tensors[name], True))
    for piece in held.pieces:  # whole: the inner optimizer is not sharded with local updates
        for key, v in piece.elements.items():
            out.own.append((f"{mine}optim.{piece.index}.{key}", v, True))
        for key, v in (piece.scalars or {}).items():
            out.own.append((f"{mine}optim_scalar.{piece.index}.{key}", v, False))
    out.own.append((f"{mine}local", own, False))
    outer_meta = _outer_cut(st["outer"], out.shared) if agreed else None
    pendings = [f for f, m in enumerate(flight["pending"]) if m is not None]
    for f in pendings:
        out.shared[f"local.pending.{f}"] = flight["pending"][f]
    out.meta = {
        "version": 1,
        "sync_every": st["sync_every"],
        "fragments": st["fragments"],
        "outer_steps": st["outer_steps"],
        "agreed": agreed,
        "anchor": None if anchor is None else where,
        "shapes": [tuple(p.shape) for p in local.params],
        "optim_index": local.optim_index,
        "outer": outer_meta,
        "pendings": pendings,
    }
    return out


def _outer_cut(outer_sd: dict[str, Any], shared: dict[str, torch.Tensor]) -> dict[str, object]:
    """The agreed outer optimizer's state: its tensors into ``shared`` (``local.outer.<j>.<key>``),
    the rest as meta.local's plain values (a tensor's place: None)."""
    plain: dict[object, dict[str, object]] = {}
    for j, values in outer_sd["state"].items():
        plain[j] = {}
        for key, v in values.items():
            if isinstance(v, torch.Tensor):
                shared[f"local.outer.{j}.{key}"] = v
                plain[j][key] = None
            else:
                plain[j][key] = v
    return {"state": plain, "param_groups": outer_sd["param_groups"]}


# ---- loading ------------------------------------------------------------------------------


def is_local(objects: Mapping[str, object]) -> bool:
    return "meta.local" in objects


def check(
    objects: dict[str, Any], optimizer: torch.optim.Optimizer, where: str, same_size: bool
) -> None:
    """Before anything is loaded: the optimizer's local-update step matches the checkpoint's."""
    meta = objects["meta.local"]
    lu = optimizer_state.local_of(optimizer)
    if lu is None:
        return
    shapes = [tuple(p.shape) for p in lu.params]
    if [tuple(s) for s in meta["shapes"]] != shapes:
        raise CheckpointError(
            f"{where}: the local-update step's {len(shapes)} parameters do not match the "
            f"checkpoint's {len(meta['shapes'])} (number or shapes).\n"
            "HINT: build the model and optimizer as they were saved."
        )
    fragments = meta.get("fragments")
    if same_size and fragments is not None and fragments != len(lu.fragments):
        raise CheckpointError(
            f"{where} was saved with outer_fragments={fragments}, this optimizer has "
            f"{len(lu.fragments)}.\nHINT: resume with outer_fragments={fragments}."
        )
    saved = objects.get("rank0.local", {}).get("codec")
    if same_size and saved not in (None, lu.codec_name) and not lu.takes_saved_codec:
        raise CheckpointError(
            f"{where} was saved with outer_compression {saved!r}, this optimizer uses "
            f"{lu.codec_name!r}.\nHINT: resume with the outer_compression it was saved with."
        )


def _anchor(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], src: int
) -> list[torch.Tensor] | None:
    """Rank ``src``'s anchor: its own while the ranks did not agree, else the shared one."""
    if meta["anchor"] is None:
        return None
    if not meta["agreed"]:
        return [tensors[f"rank{src}.local.anchor.{i}"] for i in range(len(meta["anchor"]))]
    return [tensors[fqn] for fqn in meta["anchor"]]


def _outer(
    tensors: dict[str, torch.Tensor], objects: dict[str, Any], meta: dict[str, Any], src: int
) -> dict[str, Any]:
    if not meta["agreed"]:
        return dict(objects[f"rank{src}.local"]["outer"])
    plain = meta["outer"]
    state = {
        j: {
            k: tensors[f"local.outer.{j}.{k}"]
            if v is None and f"local.outer.{j}.{k}" in tensors
            else v
            for k, v in values.items()
        }
        for j, values in plain["state"].items()
    }
    return {"state": state, "param_groups": plain["param_groups"]}


def inner_state(
    tensors: dict[str, torch.Tensor],
    objects: Mapping[str, object],
    shapes: Sequence[Sequence[int]],
    src: int,
) -> dict[int, dict[str, object]]:
    """Saved rank ``src``'s inner optimizer state, in torch's format."""
    state: dict[int, dict[str, object]] = {}
    prefix = f"rank{src}.optim."
    for fqn, t in tensors.items():
        if fqn.startswith(prefix):
            i, key = fqn[len(prefix) :].split(".", 1)
            state.setdefault(int(i), {})[key] = t.view(shapes[int(i)])
    prefix = f"rank{src}.optim_scalar."
    for fqn, v in objects.items():
        if fqn.startswith(prefix):
            i, key = fqn[len(prefix) :].split(".", 1)
            state.setdefault(int(i), {})[key] = v
    return state


@dataclass
class LoadPlan:
    """How a local-update checkpoint goes into this rank's objects."""

    exact: bool  # same world size, local-update optimizer: every rank its own state
    inner_from: int  # whose inner optimizer state this rank takes
    local: dict[str, object] | None  # the local-update step's state (LocalUpdate format), or None
    weights: list[torch.Tensor] | None  # the weights to set, in meta.local's order
    buffers: dict[str, torch.Tensor]  # model buffers to set (this rank's own)
    message: str  # what was reset ("" when nothing)


def plan(
    tensors: dict[str, torch.Tensor],
    objects: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    rank: int,
    size: int,
    saved_size: int,
) -> LoadPlan:
    meta = objects["meta.local"]
    lu = optimizer_state.local_of(optimizer)
    exact = lu is not None and size == saved_size
    src = rank if exact else 0
    anchor = _anchor(tensors, meta, src)
    own = objects[f"rank{src}.local"]
    if anchor is None:  # saved before the first step: every rank wrote its weights
        weights = [tensors[f"rank{src}.local.param.{i}"] for i in range(len(meta["shapes"]))]
    else:
        weights = list(anchor)
    buffers: dict[str, torch.Tensor] = {}
    if size == saved_size:
        mine = f"rank{rank}.model."
        buffers = {k[len(mine) :]: v for k, v in tensors.items() if k.startswith(mine)}
    if exact:
        for i in own["params"]:
            weights[i] = tensors[f"rank{rank}.local.param.{i}"]
        local: dict[str, object] = {
            "version": 3 if "fragments" in meta else 2,
            "fragments": meta.get("fragments", 1),
            "sync_every": meta["sync_every"],
            "inner_steps": own["inner_steps"],
            "outer_steps": meta["outer_steps"],
            "anchor": anchor,
            "outer": _outer(tensors, objects, meta, src),
            **_in_flight(tensors, own, meta, rank, len(weights)),
        }
        choice = own.get("outer_choice")  # None in files before it: the codec alone
        if choice is not None:
            local["outer_choice"] = choice
        return LoadPlan(True, rank, local, weights, buffers, "")
    fresh: dict[str, object] | None = None  # a new round from the anchor
    inner_from = 0
    if lu is not None:
        fresh = {
            "version": 2,
            "sync_every": meta["sync_every"],
            "inner_steps": 0,
            "outer_steps": meta["outer_steps"],
            "anchor": anchor,
            "outer": _outer(tensors, objects, meta, 0),
            "codec": {"name": lu.codec_name, "residual": None},
            "overlap": {"base": None, "pending": None, "since_sent": 0},
        }
        inner_from = rank % saved_size
    return LoadPlan(
        False,
        inner_from,
        fresh,
        weights,
        buffers,
        describe_reset(objects, saved_size, size, lu is not None),
    )


def _in_flight(
    tensors: dict[str, torch.Tensor], own: dict[str, Any], meta: dict[str, Any], rank: int, n: int
) -> dict[str, object]:
    """Rank ``rank``'s error feedback and exchanges in flight, in LocalUpdate's format: per
    fragment (version 3), or whole-model (files written before fragments: one residual, one
    pending average, all of the weights as sent, called "ref" before the delay)."""
    mine = f"rank{rank}.local"
    if "fragments" in meta:
        count = meta["fragments"]
        bases = set(own["bases"])
        return {
            "codec": {
                "name": own["codec"],
                "residual": [tensors.get(f"{mine}.residual.{f}") for f in range(count)],
            },
            "overlap": {
                "base": [tensors.get(f"{mine}.base.{i}") if i in bases else None for i in range(n)]
                if bases
                else None,
                "pending": [tensors.get(f"local.pending.{f}") for f in range(count)],
                "since_sent": own["since_sent"],
            },
        }
    base = "base" if "base" in own else "ref"
    return {
        "codec": {
            "name": own["codec"],
            "residual": tensors.get(f"{mine}.residual") if own["residual"] else None,
        },
        "overlap": {
            "base": [tensors[f"{mine}.{base}.{i}"] for i in range(n)] if own[base] else None,
            "pending": tensors.get("local.pending"),
            "since_sent": own.get("since_sent", own["inner_steps"]),
        },
    }


def describe_reset(objects: dict[str, Any], saved_size: int, size: int, local: bool) -> str:
    """The log line saying what a load that is not exact reset (see docs/checkpoint.md)."""
    meta = objects["meta.local"]
    inner = sorted({int(objects[f"rank{r}.local"]["inner_steps"]) for r in range(saved_size)})
    what = f"saved with local updates (sync_every={meta['sync_every']}) at {saved_size} ranks"
    start = f"the anchor (the weights of outer step {meta['outer_steps']})"
    if not local:
        return (
            f"ringtrain.checkpoint: {what}, loaded into an optimizer without local updates at "
            f"{size} rank(s): every rank starts from {start} with saved rank 0's inner optimizer "
            "state; the outer optimizer's state, each rank's weights since the anchor "
            f"({inner[-1]} inner step(s) at most) and its error feedback are not used."
        )
    dropped = "each rank's weights since the anchor"
    if meta.get("pendings", meta.get("pending")):
        dropped += " and the overlapped exchange in flight"
    return (
        f"ringtrain.checkpoint: {what}, loaded at {size}: every rank starts a new round from "
        f"{start} and the outer optimizer's state; reset: {dropped} ({inner[-1]} inner step(s) "
        f"at most) and the outer exchange's error feedback; rank r takes saved rank "
        f"r mod {saved_size}'s inner optimizer state."
    )


def apply(
    plan_: LoadPlan,
    objects: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    compressor: dict[str, object] | None,
    rank: int,
) -> None:
    """Put the plan into the objects (after the model's shared tensors were loaded)."""
    meta = objects["meta.local"]
    optim_meta = objects["meta.optim"]
    state = inner_state(tensors, objects, optim_meta["shapes"], plan_.inner_from)
    optimizer_state.load(optimizer, state, optim_meta["param_groups"], compressor, plan_.local)
    params = optimizer_state.params_of(optimizer)
    with torch.no_grad():
        if plan_.weights is not None:
            for i, w in zip(meta["optim_index"], plan_.weights):
                params[i].copy_(w)
        if model is not None and plan_.buffers:
            own = dict(model.named_buffers())
            for name, v in plan_.buffers.items():
                if name in own:
                    own[name].copy_(v)
    if plan_.message and rank == 0:
        log.warning("%s", plan_.message)
