"""What a local-update step saves and loads: the format of
:meth:`ringtrain.engine.local_update.LocalUpdate.local_state_dict` (version 3, per fragment) and
how the older versions (1 and 2: the whole model in one exchange) load into any number of
fragments. It reads and sets the step through :class:`Holder`, the attributes the format holds.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ringtrain.engine import outer_fragment
from ringtrain.engine.outer_fragment import Fragment
from ringtrain.errors import ConfigError


class Holder(Protocol):
    """What the format reads and sets (:class:`~ringtrain.engine.local_update.LocalUpdate`)."""

    sync_every: int
    inner_steps: int
    outer_steps: int
    anchor: list[torch.Tensor] | None
    outer: torch.optim.Optimizer
    fragments: list[Fragment]

    @property
    def params(self) -> list[torch.nn.Parameter]: ...

    @property
    def agreed(self) -> bool: ...

    @property
    def codec_name(self) -> str: ...


def save(lu: Holder, copy: bool) -> dict[str, Any]:
    """``lu``'s state; ``copy=False``: views (see ``LocalUpdate.local_state_dict``)."""
    # First: an exchange in flight sets its fragment's error feedback as it runs.
    pending = [f.finished() for f in lu.fragments]

    def own(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone() if copy else t

    base: list[torch.Tensor | None] = [None] * len(lu.params)
    for frag in lu.fragments:
        for i, b in zip(frag.indices, frag.base or []):
            base[i] = own(b)
    return {
        "version": 3,
        "sync_every": lu.sync_every,
        "fragments": len(lu.fragments),
        "inner_steps": lu.inner_steps,
        "outer_steps": lu.outer_steps,
        "agreed": lu.agreed,
        "anchor": None if lu.anchor is None else [own(a) for a in lu.anchor],
        "outer": lu.outer.state_dict(),
        "codec": {
            "name": lu.codec_name,
            "residual": [own(f.codec.residual) for f in lu.fragments],
        },
        "overlap": {
            "base": base if any(b is not None for b in base) else None,
            "pending": [own(m) for m in pending],
            "since_sent": [f.since_sent for f in lu.fragments],
        },
    }


def check(lu: Holder, state: dict[str, Any]) -> int:
    """``state``'s version, or :class:`ConfigError` where it cannot load into ``lu`` (before
    anything changes)."""
    version = state.get("version")
    if version not in (1, 2, 3):
        raise ConfigError(
            f"this is not a local-update v1, v2 or v3 state (keys {sorted(state)}).\n"
            "HINT: resume with the ringtrain version that wrote the checkpoint."
        )
    saved_fragments = int(state.get("fragments", 1))
    if version == 3 and saved_fragments != len(lu.fragments):
        raise ConfigError(
            f"the local-update state was saved with outer_fragments={saved_fragments}, this "
            f"optimizer has {len(lu.fragments)}.\nHINT: resume with outer_fragments="
            f"{saved_fragments}."
        )
    anchor = state.get("anchor")
    if anchor is not None and [a.shape for a in anchor] != [p.shape for p in lu.params]:
        raise ConfigError(
            "the saved local-update anchor does not match this model's parameters.\n"
            "HINT: load the checkpoint into the model it was saved from."
        )
    return int(version)


def restore(lu: Holder, state: dict[str, Any], version: int) -> None:
    """Set ``lu`` from ``state`` (checked by :func:`check`; nothing in flight any more)."""
    anchor = state.get("anchor")

    # Own copies on the parameters' device (a checkpoint's tensors come from host memory).
    def here(t: torch.Tensor, i: int) -> torch.Tensor:
        return t.to(lu.params[i].device, copy=True)

    lu.anchor = None if anchor is None else [here(a, i) for i, a in enumerate(anchor)]
    lu.inner_steps = int(state.get("inner_steps", 0)) % lu.sync_every
    lu.outer_steps = int(state.get("outer_steps", 0))
    lu.outer.load_state_dict(state["outer"])
    codec, saved = state["codec"], state.get("overlap") or {}
    # v1 applied the average one round late: its "ref" is the weights when it was sent.
    base = saved.get("base", saved.get("ref"))
    residuals: Any = codec["residual"]
    pendings: Any = saved.get("pending")
    since: Any = saved.get("since_sent")
    if version < 3:  # the whole model's vectors, cut into the fragments'
        residuals = outer_fragment.cut_flat(residuals, lu.fragments)
        pendings = outer_fragment.cut_flat(pendings, lu.fragments)
        since = [int(since if since is not None else lu.inner_steps)] * len(lu.fragments)
    cpu = torch.device("cpu")  # the outer exchange runs in host memory (LocalUpdate._change)
    for frag, residual, pending, sent in zip(lu.fragments, residuals, pendings, since):
        frag.codec.load_state_dict({"name": codec["name"], "residual": residual}, cpu)
        frag.restore(pending)
        frag.since_sent = int(sent)
        frag.base = None
        if pending is not None and base is not None:
            frag.base = [here(base[i], i) for i in frag.indices]
