"""How a reduction is scaled and which torch.distributed op runs it, for every reducing path.

Horovod's ``prescale_factor``/``postscale_factor`` and its Average are applied around the sum:
16-bit floats are divided before summing (so their sums cannot overflow), everything else after;
integers are scaled in double precision and truncated toward zero, as Horovod's
``ScaleBuffer``. Used by the fused allreduce, the fast lane and reducescatter alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ringtrain.collectives.requests import Request

REDUCE_OPS = {
    "Sum": dist.ReduceOp.SUM,
    "Average": dist.ReduceOp.SUM,
    "Min": dist.ReduceOp.MIN,
    "Max": dist.ReduceOp.MAX,
    "Product": dist.ReduceOp.PRODUCT,
}
LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Scaling:
    """Scale factors of one fused allreduce, applied before and after the sum.

    An Average divides by the set's size (joined ranks included) through the factor after the
    sum, as Horovod does: integers too, so an integer average is the sum times ``post / size``
    in double precision, truncated toward zero (Horovod's ``ScaleBuffer``: -75 / 2 gives -37,
    not -38).
    """

    pre: float
    post: float

    @classmethod
    def of(cls, req: Request, contributors: int, dtype: torch.dtype) -> Scaling:
        pre, post = req.prescale, req.postscale
        if req.op == "Average":
            if dtype in LOW_PRECISION:
                pre /= contributors  # divide before summing so 16-bit sums cannot overflow
            else:
                post /= contributors
        return cls(pre, post)

    def before(self, flat: torch.Tensor) -> None:
        if self.pre != 1.0:
            scale(flat, self.pre)

    def after(self, flat: torch.Tensor) -> None:
        if self.post != 1.0:
            scale(flat, self.post)


def scale(t: torch.Tensor, factor: float) -> None:
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_((t.double() * factor).to(t.dtype))
