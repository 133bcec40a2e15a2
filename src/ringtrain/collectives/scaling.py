"""How a reduction is scaled and which reduction of the wire runs it, for every reducing path.

Horovod's ``prescale_factor``/``postscale_factor`` and its Average are applied around the sum,
by the one averaging rule (:mod:`ringtrain.compression.averaging`). Used by the fused allreduce,
the fast lane and reducescatter alike.
"""

from __future__ import annotations

import torch

from ringtrain.collectives.requests import Request
from ringtrain.compression import averaging
from ringtrain.compression.averaging import Factors

# Horovod's ops by the name of the reduction that runs them (ringtrain.transport.group_ops).
REDUCE_OPS = {"Sum": "sum", "Average": "sum", "Min": "min", "Max": "max", "Product": "product"}


def scaling_of(req: Request, contributors: int, dtype: torch.dtype) -> Factors:
    """The scale factors of one request's reduction (:mod:`ringtrain.compression.averaging`:
    an Average's division before the sum for 16-bit floats, after it otherwise, integers
    truncated toward zero)."""
    return averaging.factors(req.op == "Average", contributors, dtype, req.prescale, req.postscale)
