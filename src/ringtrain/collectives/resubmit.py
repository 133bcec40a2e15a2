"""A named allreduce submitted again with the request it made before.

Most collectives repeat: the same name, shape, dtype and arguments every step. Building their
request again (its metadata, a dataclass, its hash, the request cache's lookup of an equal but
new object) is a good part of the caller's Python per op (issue 38). So a request the ranks
have run alike, and the fast lane's reservation, are kept with the caller's arguments that
submit exactly them (:class:`Repeat`): an allreduce of one tensor compares its arguments with
that and, where they match, submits the very same request object.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ringtrain.collectives import dtypes
from ringtrain.collectives.requests import Request


class Repeat(NamedTuple):
    """A one-tensor allreduce's request, with the arguments that submit exactly it."""

    request: Request
    shape: tuple[int, ...]
    dtype: torch.dtype
    args: tuple[str, float, float]  # op, prescale, postscale

    def matches(
        self, name: str, t: torch.Tensor, op: str, prescale: float, postscale: float
    ) -> bool:
        """Whether an allreduce of CPU tensor ``t`` with these arguments submits ``request``
        (strides play no part: a request does not hold them)."""
        if name != self.request.name or t.layout is not torch.strided or not t.is_cpu:
            return False
        return (
            t.dtype == self.dtype
            and t.shape == self.shape
            and (op, prescale, postscale) == self.args
        )


def of(req: Request) -> Repeat | None:
    """``req`` as a :class:`Repeat`, worked out once per request object; None where no call of
    one CPU tensor submits it (another kind, several tensors, another device, an error)."""
    return req.derived("resubmit", _make)


def _make(req: Request) -> Repeat | None:
    if req.kind != "allreduce" or req.error or len(req.tensors) != 1 or req.splits or req.extra:
        return None
    meta = req.tensors[0]
    if meta.device != "cpu":
        return None
    args = (req.op, req.prescale, req.postscale)
    return Repeat(req, tuple(meta.shape), dtypes.from_name(meta.dtype), args)
