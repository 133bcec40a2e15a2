"""The parameters one DistributedOptimizer reduces: their names, and the hooks that tell it
when each one's gradient is ready."""

from __future__ import annotations

import functools
import weakref
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ringtrain.collectives import crossset
from ringtrain.diagnostics import engine_wait
from ringtrain.errors import ConfigError


def names_of(
    optimizer: torch.optim.Optimizer,
    named: Iterable[tuple[str, torch.nn.Parameter]] | None,
    old: dict[torch.nn.Parameter, str],
) -> tuple[list[torch.nn.Parameter], list[str]]:
    """The optimizer's parameters in order and their names: from ``named`` (checked), else as
    before (``old``), else Horovod's ``allreduce.noname.<group>.<position>``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named is not None:
        pairs = list(named)
        if any(not isinstance(p, tuple) or len(p) != 2 for p in pairs):
            raise ConfigError(
                "named_parameters must be an iterable of (name, parameter), "
                "e.g. model.named_parameters()"
            )
        names = [n for n, _ in pairs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"named_parameters has duplicate names: {dupes}")
        by_param = {p: n for n, p in pairs}
        missing = [i for i, p in enumerate(params) if p not in by_param]
        if missing:
            raise ConfigError(
                f"{len(missing)} optimizer parameter(s) are not in named_parameters "
                f"(positions {missing[:5]}).\nHINT: pass the named_parameters() of the model "
                "whose parameters the optimizer holds."
            )
        old = by_param
    unnamed = {
        p: f"allreduce.noname.{g}.{j}"
        for g, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
    }
    return params, [old.get(p, unnamed[p]) for p in params]


def make_watch(
    owner: object, comm: Any, names: list[str], stall_s: tuple[float, float], timeout_s: float
) -> engine_wait.WaitWatch | None:
    """Names the ranks elsewhere when synchronize() waits past the stall warning time, and
    ends the wait past the stall shutdown time (``stall_s``: both). Keyed by the parameter
    names, which every rank's optimizer of one model shares."""
    warning_s, shutdown_s = stall_s
    if comm.size == 1 or not comm.included or comm.store is None or warning_s <= 0:
        return None
    crc = zlib.crc32("\n".join(names).encode())
    ctl = comm.service("controller")
    board = ctl.board if ctl is not None else None
    watch = engine_wait.WaitWatch(
        comm.store,
        f"ringtrain/engine/set{comm.set_id}/{crc:08x}",
        comm.ranks[comm.set_rank],
        comm.ranks,
        warning_s,
        timeout_s,
        doing=None if board is None else functools.partial(_stuck_in, board),
        shutdown_s=shutdown_s,
    )
    weakref.finalize(owner, watch.close)
    return watch


def _stuck_in(board: crossset.Board, rank: int) -> str:
    """The collectives ``rank`` posted as waiting in its controllers (explicit ones such as
    ``hvd.allreduce``), for a wait in ``step()`` that it never joined; '' if none."""
    stuck = board.read(rank)
    return ", ".join(f"collective {s.name!r} (process set {s.set_id})" for s in stuck)


class Hooks:
    """One post-accumulate-grad hook per trainable parameter, calling
    ``owner._on_grad_ready(index, param)``. Each holds its owner weakly: hooks live in the
    parameter's C++ autograd data, out of sight of Python's garbage collector, so a strong
    reference would make optimizer -> parameters -> hook -> optimizer a cycle that is never
    freed, and a dropped optimizer would keep its reducer threads and buffers for the life of
    the process. Dropped without ``remove()``, the owner takes its hooks off the parameters."""

    def __init__(self, owner: object) -> None:
        self._owner = weakref.ref(owner)
        self._handles: dict[int, Any] = {}
        weakref.finalize(owner, _remove, self._handles)

    def add(self, params: list[torch.nn.Parameter]) -> None:
        for i, p in enumerate(params):
            if p.requires_grad and i not in self._handles:
                self._handles[i] = p.register_post_accumulate_grad_hook(
                    functools.partial(_grad_ready, self._owner, i)
                )

    def remove(self) -> None:
        _remove(self._handles)


def _grad_ready(owner: Callable[[], Any], index: int, param: Any) -> None:
    opt = owner()
    if opt is not None:
        opt._on_grad_ready(index, param)


def _remove(handles: dict[int, Any]) -> None:
    for h in handles.values():
        h.remove()
    handles.clear()
