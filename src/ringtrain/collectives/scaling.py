"""How a reduction is scaled and which torch.distributed op runs it, for every reducing path.

Horovod's ``prescale_factor``/``postscale_factor`` and its Average are applied around the sum,
by the one averaging rule (:mod:`ringtrain.compression.averaging`). Used by the fused allreduce,
the fast lane and reducescatter alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringtrain.collectives.requests import Request
from ringtrain.compression import averaging
from ringtrain.compression.averaging import Factors

REDUCE_OPS = {
    "Sum": dist.ReduceOp.SUM,
    "Average": dist.ReduceOp.SUM,
    "Min": dist.ReduceOp.MIN,
    "Max": dist.ReduceOp.MAX,
    "Product": dist.ReduceOp.PRODUCT,
}


def scaling_of(req: Request, contributors: int, dtype: torch.dtype) -> Factors:
    """The scale factors of one request's reduction (:mod:`ringtrain.compression.averaging`:
    an Average's division before the sum for 16-bit floats, after it otherwise, integers
    truncated toward zero)."""
    return averaging.factors(req.op == "Average", contributors, dtype, req.prescale, req.postscale)
