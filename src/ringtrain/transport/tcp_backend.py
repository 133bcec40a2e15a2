"""``ringtrain_tcp``: ringtrain's own data path, for hosts where Gloo cannot start (enclaves).

Gloo's TCP device calls ``getifaddrs()`` when it is made, even from an explicit address, and
``getifaddrs()`` needs a netlink socket, which enclave runtimes such as Gramine do not have. So
a job that runs in an enclave uses ``transport = "tcp"`` (``RINGTRAIN_TRANSPORT=tcp``,
``ringtrain run --transport tcp``): every process group is then a :class:`TcpProcessGroup`
(or, with ``secure``, a sealed group over the same mesh), which runs ringtrain's ring algorithms
(:class:`ringtrain.transport.ring.Ring`, unsealed here) over plain TCP sockets between the
members (:class:`ringtrain.transport.tcp_mesh.Mesh`), connected through the job's store.

``transport = "auto"`` (the default) uses Gloo unless this process cannot open a netlink socket
(one ``socket(AF_NETLINK)`` attempt at ``init``); ``"gloo"`` and ``"tcp"`` decide outright, and
``"tcp"`` makes no netlink attempt at all.

Each member listens on one address, found without netlink: the first interface of
``network_interface`` / ``GLOO_SOCKET_IFNAME`` by one ``SIOCGIFADDR`` ioctl (or the address, if
an address is given), else the local address the kernel routes to the rendezvous host from
(a UDP ``connect``, which sends nothing).

Plain DDP can use it too::

    import ringtrain.transport.tcp_backend   # registers "ringtrain_tcp"
    dist.init_process_group("ringtrain_tcp", ...)
"""

from __future__ import annotations

import datetime
import errno
import socket
import threading
from collections.abc import Mapping

import torch.distributed as dist

from ringtrain import environ
from ringtrain.config import env_var
from ringtrain.environ import Ringtrain, Torch
from ringtrain.host.network import local_address
from ringtrain.transport.ring import Plain, Ring
from ringtrain.transport.ring_group import RingProcessGroup
from ringtrain.transport.tcp_mesh import Mesh

BACKEND = "ringtrain_tcp"
TRANSPORTS = ("auto", "gloo", "tcp")

_address: str | None = None
_lock = threading.Lock()


def configure(address: str) -> None:
    """The address this process's TCP groups listen on (set by ``ringtrain.init``)."""
    global _address
    with _lock:
        _address = address


def configured() -> bool:
    """Whether ``ringtrain.init`` chose this transport: this process's groups, plain or sealed,
    run on the TCP mesh (the enclave transport)."""
    with _lock:
        return _address is not None


def deconfigure() -> None:
    global _address
    with _lock:
        _address = None


def netlink_available() -> bool:
    """Whether this process can open a netlink socket (it cannot in Gramine enclaves)."""
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0):
            return True
    except OSError as e:
        if e.errno in (errno.EAFNOSUPPORT, errno.EPERM, errno.EACCES, errno.ENOSYS):
            return False
        raise
    except AttributeError:  # no AF_NETLINK: not Linux, and Gloo does not need it there
        return True


def choose(transport: str) -> str:
    """``"gloo"`` or ``"tcp"`` for a Config's ``transport``."""
    if transport == "auto":
        return "gloo" if netlink_available() else "tcp"
    return transport


def address_from_env(env: Mapping[str, str] | None = None) -> str:
    """The address for a group made outside ``ringtrain.init``'s choice (plain DDP, or a
    ``ringtrain_tcp`` group in a Gloo job, as ``ringtrain bench allreduce --tcp`` makes)."""
    env = environ.current() if env is None else env
    interface = env.get(Torch.GLOO_SOCKET_IFNAME) or env.get(env_var("network_interface"), "")
    rendezvous = env.get(Torch.MASTER_ADDR) or env.get(Ringtrain.RENDEZVOUS_ADDR, "")
    return local_address(interface, rendezvous)


def mesh(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> Mesh:
    """A mesh for one group, on the configured address (or one found from the environment)."""
    with _lock:
        address = _address
    return Mesh(dist.PrefixStore("tcp", store), rank, size, timeout, address or address_from_env())


class TcpProcessGroup(RingProcessGroup):
    """Ring collectives over ringtrain's TCP mesh, in plain bytes."""

    backend_name = BACKEND

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
    ) -> None:
        super().__init__(rank, size)
        link = Ring(mesh(store, rank, size, timeout), Plain(rank, size))
        self._begin(link, f"ringtrain-tcp-{rank}")


def register() -> None:
    """Make ``ringtrain_tcp`` known to torch.distributed (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def _create(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
) -> TcpProcessGroup:
    return TcpProcessGroup(store, rank, size, timeout)


register()
