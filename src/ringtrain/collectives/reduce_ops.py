"""Reduce operations, with Horovod's names (``Average``, ``Sum``, ``Min``, ``Max``, ``Product``)."""

from __future__ import annotations

import warnings
from enum import Enum
from typing import TYPE_CHECKING, TypeAlias

from ringtrain.errors import CollectiveArgumentError, CollectiveUnsupportedError

if TYPE_CHECKING:
    from ringtrain.runtime.process_sets import ProcessSet


class ReduceOp(str, Enum):
    AVERAGE = "Average"
    SUM = "Sum"
    MIN = "Min"
    MAX = "Max"
    PRODUCT = "Product"
    ADASUM = "Adasum"

    def __str__(self) -> str:
        return self.value


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

# What an ``op=`` argument takes: a ReduceOp, its name in any case ("sum", "avg", "mean"), or
# Horovod's number for it.
ReduceOpLike: TypeAlias = ReduceOp | str | int


_ALIASES = {m.value.lower(): m.value for m in ReduceOp} | {"avg": "Average", "mean": "Average"}
# Horovod's hvd.Average, hvd.Sum, ... are these ints (enum ReduceOp, horovod/common/message.h):
# an op a Horovod program kept as a number means the same here.
_HOROVOD_NUMBERS = dict(enumerate((Average, Sum, Adasum, Min, Max, Product)))


def is_adasum(op: object) -> bool:
    """Whether ``op`` names Adasum in any form ``op=`` takes (the enum, its name, Horovod's 2)."""
    if isinstance(op, str):  # ReduceOp is a str: ReduceOp.ADASUM == "Adasum"
        return op.lower() == "adasum"
    return isinstance(op, int) and not isinstance(op, bool) and op == 2


def resolve_op(
    op: ReduceOpLike | None, average: bool | None = None, default: ReduceOp = Average
) -> str:
    """The op's name, honouring Horovod's deprecated ``average=`` flag; rejects what we lack."""
    if average is not None:
        if op is not None:
            raise CollectiveArgumentError("pass either op= or the deprecated average=, not both")
        warnings.warn(
            "Parameter `average` has been replaced with `op` and will be removed in v1.0",
            DeprecationWarning,  # Horovod's warning, word for word
            stacklevel=3,
        )
        op = Average if average else Sum
    if op is None:
        op = default
    if isinstance(op, ReduceOp) and op is not Adasum:
        return op.value  # the usual case, without the enum's lookup by value
    if isinstance(op, str) and not isinstance(op, ReduceOp):
        # Also accept "sum", "avg", "mean" and torch-style spellings.
        op = _ALIASES.get(op.lower(), op)
    elif isinstance(op, int) and not isinstance(op, bool):  # True is not Sum
        op = _HOROVOD_NUMBERS.get(op, op)
    try:
        op = ReduceOp(op if not isinstance(op, ReduceOp) else op.value)
    except ValueError:
        raise CollectiveArgumentError(
            f"unknown reduce op {op!r}; use one of Average, Sum, Min, Max, Product (or "
            "Horovod's numbers for them, 0, 1, 3, 4, 5)"
        ) from None
    if op is Adasum:
        # NotImplementedError (a RuntimeError), as Horovod raises for the Adasum setups it lacks.
        raise CollectiveUnsupportedError(
            "op=Adasum is not supported by ringtrain.\n"
            "HINT: use Average (the default) or Sum; Adasum needs Horovod's MPI build."
        )
    return op.value


def resolve_allreduce_op(
    op: ReduceOpLike | None, average: bool | None, ps: ProcessSet | None
) -> str:
    """resolve_op for an allreduce over ``ps``. Adasum over a world of one rank returns that
    rank's tensor, as Horovod's does (its Adasum has no peer to combine with: Sum of one);
    on any other process set Horovod raises NotImplementedError, and so does this."""
    if average is None and is_adasum(op):
        from ringtrain.runtime import state

        if ps is not None and ps != state.global_process_set:
            raise CollectiveUnsupportedError(
                f"op=Adasum on {ps!r}: Adasum runs only on the global process set, as in "
                "Horovod ('Adasum does not support non-global process sets yet').\n"
                "HINT: use op=Average or op=Sum on a process set."
            )
        if state.current().size == 1:
            return Sum.value
    return resolve_op(op, average)
