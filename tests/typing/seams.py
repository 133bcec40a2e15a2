"""The classes behind each seam's protocol satisfy it; `make lint` runs mypy on this file.

Never run. A protocol's method that a class lacks or spells differently (a rename inside the
engine, a torch upgrade that changes a stub) fails the lint here, at the seam, rather than in a
spawned test. The protocols are those of ringtrain.runtime.contracts.
"""

from __future__ import annotations

import torch.distributed as dist

from ringtrain.runtime.contracts import Group, Store, Work


def torch_objects(
    group: dist.ProcessGroup,
    store: dist.Store,
    tcp: dist.TCPStore,
    prefix: dist.PrefixStore,
    hashed: dist.HashStore,
    work: dist.Work,
) -> tuple[Group, list[Store], Work]:
    return group, [store, tcp, prefix, hashed], work
