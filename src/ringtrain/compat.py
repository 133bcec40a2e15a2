"""torch.distributed names that differ across the torch releases ringtrain supports.

Newer torch names the one-tensor gather and reduce-scatter ``all_gather_single`` and
``reduce_scatter_single`` and warns on the old names (``all_gather_into_tensor``,
``reduce_scatter_tensor``); older releases have only the old names. Same arguments either way.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

all_gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Any = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)
