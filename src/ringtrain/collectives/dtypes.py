"""Make every dtype torch offers travel over Gloo, which handles only some of them.

Data movement (broadcast, allgather, alltoall) reinterprets unsupported dtypes as bytes, so it is
exact for all of them. Reductions convert to a dtype Gloo can reduce: narrow and unsigned integers
to int64, float8 to float32. Gloo would sum int8 and uint8 itself, but in their own width: two
ranks' 100s averaged to -28, not 100. Summed in int64 (exact below 2**63), an Average or a scaled
result that fits the dtype is exact (truncated toward zero, as Horovod's); one that does not fit
wraps on the cast back, modulo 2**bits, as torch's own arithmetic on the dtype wraps (int8
100 + 100 is -56); uint64 sums wrap exactly as uint64 would. (Horovod refuses int8, uint8 and
int16 reductions.) Complex tensors reduce as pairs of reals for Sum/Average; Min/Max/Product have
no complex meaning. bool reduces as torch's elementwise bool arithmetic: Sum and Max are a
logical or, Min and Product a logical and; an Average has no bool meaning (torch.mean refuses
bool too), so it is refused rather than given as an or.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ringtrain.collectives.requests import TensorMeta
from ringtrain.errors import CollectiveArgumentError
from ringtrain.transport import views

GLOO_NATIVE = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,  # moved as they are; reduced widened (_WIDEN_INT)
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
}
_WIDEN_INT = {torch.int8, torch.uint8, torch.int16, torch.uint16, torch.uint32}
_FLOAT8 = {
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
}


def from_name(name: str) -> torch.dtype:
    """The dtype a request names (``str(dtype)``, e.g. "torch.float32")."""
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype), name
    return dtype


def nbytes_of(metas: Iterable[TensorMeta]) -> int:
    """The bytes of the tensors a request describes."""
    return sum(math.prod(m.shape) * from_name(m.dtype).itemsize for m in metas)


def reduction_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    """The dtype to reduce ``dtype`` in; raises for combinations that have no meaning."""
    if dtype.is_complex and op in ("Min", "Max", "Product"):
        raise CollectiveArgumentError(
            f"{op} is not defined for complex tensors ({dtype}); use Sum or Average"
        )
    if dtype == torch.bool and op == "Average":
        raise CollectiveArgumentError(
            f"Average is not defined for {dtype} tensors (Horovod refuses bool reductions).\n"
            "HINT: cast to a float (t.float()) for the fraction of ranks, or to an integer for "
            "the count (op=Sum); Sum/Max of bool give a logical or, Min a logical and."
        )
    if dtype in _WIDEN_INT or dtype == torch.uint64:
        return torch.int64
    if dtype in GLOO_NATIVE:
        return dtype
    if dtype in _FLOAT8:
        return torch.float32
    raise CollectiveArgumentError(f"reductions of {dtype} are not supported")


def refusal(tensors: Sequence[Any], op: str, pre: float = 1.0, post: float = 1.0) -> str:
    """Why ``op`` (with scale factors ``pre``, ``post``) cannot reduce ``tensors``, or '':
    asked at submission, so that every rank raises it before any data moves."""
    for dtype in dict.fromkeys(t.dtype for t in tensors if isinstance(t, torch.Tensor)):
        try:
            reduction_dtype(dtype, op)
        except CollectiveArgumentError as e:
            return str(e)
        if dtype == torch.bool and (pre != 1.0 or post != 1.0):
            return (
                f"a {dtype} tensor cannot be scaled (prescale_factor={pre}, "
                f"postscale_factor={post}).\nHINT: cast it to a float or integer dtype first."
            )
    return ""


def to_reducible(t: torch.Tensor, op: str) -> torch.Tensor:
    """``t`` in a dtype Gloo reduces (a view when possible, else a converted copy)."""
    target = reduction_dtype(t.dtype, op)
    if target == t.dtype:
        return t
    if t.dtype == torch.uint64:
        return t.view(torch.int64)
    return t.to(target)


def to_reducible_all(tensors: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    """:func:`to_reducible` of each; checked per dtype, not per tensor, when none change (a
    grouped call may hold a thousand tensors of one dtype)."""
    if all(reduction_dtype(d, op) == d for d in {t.dtype for t in tensors}):
        return tensors
    return [to_reducible(t, op) for t in tensors]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of ``t`` (of a contiguous copy where ``t`` is not contiguous), shaped
    ``(rows, bytes_per_row)`` so dim 0 survives. The row's width comes from the shape, not the
    data, so a rank that sends no rows agrees with its peers on it."""
    rows = t.shape[0] if t.dim() > 0 else 1
    width = math.prod(t.shape[1:]) * t.element_size()
    if t.numel() == 0:
        return torch.empty((rows, width), dtype=torch.uint8, device=t.device)
    # flat: torch calls a tensor contiguous whatever the strides of its size-1 dimensions
    # (x.t() of a (1, n) tensor), and view(uint8) needs a last stride of 1
    return views.as_u8(t).view(rows, width)


def movable(t: torch.Tensor) -> bool:
    """Whether Gloo can move ``t`` as it is."""
    return t.dtype in GLOO_NATIVE
