"""Collectives on picklable Python objects, plus ``barrier`` and ``join``.

Objects travel as pickled bytes (cloudpickle, as Horovod's: functions and classes by value)
through the same negotiated tensor collectives, so they are matched by name, checked, and (in
secure mode) sealed like everything else. Receivers of a broadcast need not know the object's
size: the root's request carries it. An object that cannot be pickled fails on every rank.
"""

from __future__ import annotations

import pickle
from typing import Any, TypeVar, cast

import cloudpickle
import torch

from ringtrain.collectives import ops
from ringtrain.collectives.controller import JOIN_NAME
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.diagnostics import engine_wait
from ringtrain.runtime.process_sets import ProcessSet

T = TypeVar("T")


def _dumps(obj: Any) -> tuple[torch.Tensor | None, str]:
    """The object's bytes, or None and why it cannot travel. By value (cloudpickle, as
    Horovod's): a lambda or a class defined in ``__main__`` travels too."""
    try:
        data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        return None, (
            f"the object of type {type(obj).__name__} cannot be pickled: {e}\n"
            "HINT: send only what cloudpickle can serialize (no open files, sockets or locks)."
        )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8), ""


def _loads(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


def broadcast_object(
    obj: T, root_rank: int = 0, name: str | None = None, process_set: ProcessSet | None = None
) -> T:
    """``root_rank``'s object, on every rank of the process set."""
    ctl = ops.controller_of(process_set)
    name = name if name is not None else ctl.auto_name("broadcast_object")
    root, err = ops.checked_root(root_rank, ctl.comm.ranks)
    if err:
        bad = ctl.submit(Request(name, "broadcast", root=-1, error=err), [], [])
        return cast(T, ops.synchronize(bad))  # raises the error on every rank
    if ctl.comm.world_rank == root:  # a global rank, as in Horovod
        data, err = _dumps(obj)
        if data is None:  # every rank raises it, rather than waiting for the root
            bad = ctl.submit(Request(name, "broadcast", root=root, error=err), [], [])
            return cast(T, ops.synchronize(bad))
        req = Request(
            name,
            "broadcast",
            (TensorMeta(tuple(data.shape), str(data.dtype)),),
            root=root,
            shape_from_root=True,
        )
        handle = ctl.submit(req, [data], [data])
    else:
        req = Request(
            name,
            "broadcast",
            (TensorMeta((0,), str(torch.uint8)),),
            root=root,
            shape_from_root=True,
        )
        handle = ctl.submit(req, [torch.empty(0, dtype=torch.uint8)], [])
    return cast(T, _loads(ops.synchronize(handle)[0]))


def allgather_object(
    obj: T, name: str | None = None, process_set: ProcessSet | None = None
) -> list[T]:
    """Every rank's object, as a list in rank order."""
    ctl = ops.controller_of(process_set)
    name = name if name is not None else ctl.auto_name("allgather_object")
    data, err = _dumps(obj)
    if data is None:  # every rank raises it at the sizes' allgather
        bad = ctl.submit(Request(f"{name}.sizes", "allgather", error=err), [], [])
        return cast(list[T], ops.synchronize(bad))
    sizes = ops.synchronize(
        ops.allgather_async(
            torch.tensor([data.numel()], dtype=torch.int64), f"{name}.sizes", process_set
        )
    )
    gathered = ops.synchronize(ops.allgather_async(data, name, process_set))
    out: list[T] = []
    offset = 0
    for n in sizes.tolist():
        out.append(_loads(gathered[offset : offset + n]))
        offset += n
    return out


def barrier(process_set: ProcessSet | None = None) -> None:
    """Wait until every rank of the set reaches its barrier. Pending async ops keep running."""
    ctl = ops.controller_of(process_set)
    ops.synchronize(ctl.submit(Request(ctl.auto_name("barrier"), "barrier"), [], []))


def join(device: int = -1, process_set: ProcessSet | None = None) -> int:
    """Declare that this rank has no more data; returns the (global) rank that joined last.

    As in Horovod: until every rank has joined, this rank stands in for the allreduces its peers
    still run, contributing zeros (Average still divides by every rank of the set), and their
    barriers pass without it. Allgather, broadcast, alltoall and reducescatter fail on the active
    ranks while any rank has joined, as they do in Horovod; so do allreduces with Min, Max or
    Product, which would take the zeros for data (Horovod reduces the zeros with them)."""
    ctl = ops.controller_of(process_set)
    handle = ctl.submit(Request(JOIN_NAME, "join"), [], [])
    # Not for DistributedOptimizer's step(), whose exchange is not negotiated: a peer that
    # waits in a step this rank never took is an error here, not a wait until the timeout.
    engine_wait.standing_in(ctl.comm.ranks, handle.finished_within)
    last: int = ops.synchronize(handle)
    return last
