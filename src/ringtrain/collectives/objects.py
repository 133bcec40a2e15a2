"""Collectives on picklable Python objects, plus ``barrier`` and ``join``.

Objects travel as pickled bytes through the same negotiated tensor collectives, so they are
matched by name, checked, and (in secure mode) sealed like everything else. Receivers of a
broadcast need not know the object's size: the root's request carries it.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, TypeVar, cast

import torch

from ringtrain.collectives import ops
from ringtrain.collectives.controller import JOIN_NAME
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.errors import CollectiveArgumentError
from ringtrain.runtime.process_sets import ProcessSet

T = TypeVar("T")


def _dumps(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    try:
        pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        raise CollectiveArgumentError(
            f"object of type {type(obj).__name__} cannot be pickled: {e}"
        ) from e
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


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
        data = _dumps(obj)
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
    data = _dumps(obj)
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
    last: int = ops.synchronize(ctl.submit(Request(JOIN_NAME, "join"), [], []))
    return last
