"""What the runtime asks of the process-group backends built above it.

The runtime creates torch's default group on whichever backend it is handed. The backends
ringtrain provides itself (the sealed groups, the TCP mesh: :mod:`ringtrain.transport`) are
built on the runtime, so the runtime never imports them: ``lifecycle``, the composition root,
passes :class:`ringtrain.transport.backend_choice.Backends`, which implements this protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch.distributed as dist

from ringtrain.config import Config
from ringtrain.runtime.environment import Placement


class GroupBackends(Protocol):
    def choose(
        self, config: Config, env: Mapping[str, str], placement: Placement
    ) -> tuple[str, str]:
        """``(backend, transport)``: the torch backend name of every group, and what carries
        it (``"gloo"`` or ``"tcp"``); configures the transport for this process."""
        ...

    def seal(
        self,
        store: dist.Store,
        config: Config,
        env: Mapping[str, str],
        placement: Placement,
        transport: str,
    ) -> dist.Store:
        """The store a secure job's groups use, once this rank proved it holds the job key."""
        ...

    def release(self, config: Config, *, keep_key: bool = False) -> None:
        """Forget what :meth:`choose` and :meth:`seal` configured (``keep_key``: for the next
        world of the same elastic job)."""
        ...
