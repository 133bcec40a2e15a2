"""Checkpoints: every rank writes its own part, loadable at any world size, verified, sealed.

    import ringtrain.checkpoint as ckpt
    ckpt.save("ckpt/step-100", model=model, optimizer=opt, sampler=sampler, step=100)
    restored = ckpt.load("ckpt", model=model, optimizer=opt, sampler=sampler)

Layering: ``manifest`` (plain Python: commit by rename, verification) < ``layout`` (DCP's
file format) < ``sealed`` < ``store`` (write a part, commit, open) < ``optimizer_state`` (the
one adapter onto the engine) < ``local_state`` (a local-update optimizer's shared and per-rank
state) < ``parts`` (what each rank writes, reassembly) < ``api``
(``save``/``load``, collective) < ``thread_writer`` < ``writer`` (asynchronous saves: a writer process, or a thread in enclaves) < ``durable`` (saves on the job's
schedule, ``--resume``). See docs/checkpoint.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringtrain.checkpoint.api import Restored, latest, load, save
    from ringtrain.checkpoint.durable import Durable
    from ringtrain.checkpoint.samplers import Remaining
    from ringtrain.checkpoint.writer import Checkpointer

__all__ = ["Checkpointer", "Durable", "Remaining", "Restored", "latest", "load", "save"]

# Each public name's module, imported at first use: the writer process imports this package
# too, and needs none of the training side (PEP 562).
_HOMES = {
    "Checkpointer": "writer",
    "Durable": "durable",
    "Remaining": "samplers",
    "Restored": "api",
    "latest": "api",
    "load": "api",
    "save": "api",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
