"""The process-group backends of a job, picked for the runtime (see
:mod:`ringtrain.runtime.backends`): Gloo, ringtrain's TCP mesh, and the sealed groups.

``lifecycle`` hands :class:`Backends` to ``runtime.state.start``; the modules that build the
groups are imported only when a job uses them (the sealed ones need the job key).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from ringtrain.config import Config
from ringtrain.environ import Torch
from ringtrain.host import network
from ringtrain.launch.elastic import ID_VAR as ELASTIC_ID_VAR
from ringtrain.runtime.environment import Placement

if TYPE_CHECKING:
    import torch.distributed as dist

log = logging.getLogger("ringtrain")


class Backends:
    """Implements :class:`ringtrain.runtime.backends.GroupBackends`."""

    def choose(
        self, config: Config, env: Mapping[str, str], placement: Placement
    ) -> tuple[str, str]:
        if config.transport == "gloo":
            transport = "gloo"
        else:
            from ringtrain.transport import tcp_backend

            transport = tcp_backend.choose(config.transport)
            if (
                transport == "gloo"
                and config.secure
                and config.transport == "auto"
                and ELASTIC_ID_VAR in env
            ):
                # An elastic job leaks the sealed groups of the worlds it abandons, and their
                # workers may still wait in a Gloo receive; one that returns while the
                # interpreter exits aborts the process. The TCP mesh waits in Python instead
                # (docs/elastic.md).
                transport = "tcp"
            if transport == "tcp":
                interface = env.get(Torch.GLOO_SOCKET_IFNAME) or config.network_interface
                address = network.local_address(interface, placement.rendezvous_addr)
                tcp_backend.configure(address)
                log.debug("transport: ringtrain's TCP mesh (no Gloo devices)")
        if config.secure:
            from ringtrain.transport import sealed_backend

            return sealed_backend.BACKEND, transport
        return ("gloo" if transport == "gloo" else "ringtrain_tcp"), transport

    def seal(
        self,
        store: dist.Store,
        config: Config,
        env: Mapping[str, str],
        placement: Placement,
        transport: str,
    ) -> dist.Store:
        from ringtrain.transport import sealed_backend

        return sealed_backend.join(store, config, env, placement.rank, placement.size, transport)

    def release(self, config: Config, *, keep_key: bool = False) -> None:
        if config.secure:  # the next job brings its own key and store
            from ringtrain.transport import sealed_backend

            sealed_backend.deconfigure(keep_key=keep_key)
        if config.transport != "gloo":
            from ringtrain.transport import tcp_backend

            tcp_backend.deconfigure()
