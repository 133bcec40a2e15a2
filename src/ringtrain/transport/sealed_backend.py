"""``ringtrain_sealed``: a torch.distributed backend whose traffic is sealed end to end.

Registered with ``torch.distributed.Backend.register_backend``, it is a Python
``ProcessGroup`` (:class:`~ringtrain.transport.ring_group.RingProcessGroup`) that runs
:mod:`ringtrain.transport.ring` over a private Gloo group, or, with ``transport = "tcp"``
(enclaves, where Gloo cannot start), over ringtrain's TCP mesh
(:mod:`ringtrain.transport.tcp_backend`). Any
``torch.distributed`` call on such a group (``all_reduce``, ``broadcast``, ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``barrier``,
``send``/``recv``) is sealed, so ringtrain's controller, executor and engine use it without
knowing, and so does plain DDP::

    import ringtrain.transport.sealed_backend   # registers the backend
    dist.init_process_group("ringtrain_sealed", ...)   # key from RINGTRAIN_KEY_FILE / _KEY_FD
    model = DDP(model)

How it runs. Each group owns one worker thread that runs its operations in call order (the order
the transport needs) and returns a :class:`SealedWork` at once, so ``async_op=True`` overlaps as
with Gloo.
At creation every member posts a fresh random value (with its global rank and host) in the
group's store; the session key is derived from the job key and all of them (see
:mod:`ringtrain.security.sealing`).

Failure. A message that does not open raises :class:`~ringtrain.errors.SecurityError` on the
rank that received it, which (1) poisons every sealed group of this process (later calls fail at
once with the same error) and (2) posts the error under a job-wide key in the rendezvous store.
A rank waiting on a sealed operation checks that key while it waits, so every rank raises the
same SecurityError, naming the peer, within about :data:`NOTICE_POLL_S`, instead of waiting for
a message that will never come. Worker threads stuck in Gloo are daemons and end at its timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

import torch.distributed as dist

from ringtrain import environ
from ringtrain.config import Config
from ringtrain.environ import Ringtrain, Torch
from ringtrain.errors import SecurityError
from ringtrain.host import network
from ringtrain.runtime import exit_guard
from ringtrain.runtime.contracts import Store
from ringtrain.security import keys, rendezvous, sealing
from ringtrain.transport import tcp_backend
from ringtrain.transport.ring import Channel, Ring
from ringtrain.transport.ring_group import NOTICE_POLL_S, RingProcessGroup, RingWork

log = logging.getLogger("ringtrain")

BACKEND = "ringtrain_sealed"
__all__ = ["BACKEND", "NOTICE_POLL_S", "SealedProcessGroup", "SealedWork", "configure", "join"]
_NOTICE_KEY = "ringtrain_sealed/failure"


@dataclass
class Context:
    """What sealed groups of this process need: set by :func:`configure` (ringtrain.init)."""

    sealing_key: bytes
    job_id: str
    rank: int  # global rank
    host: str
    notices: Store  # a store shared by the whole job (this generation), for failure notices
    interface: str = ""  # Gloo's interface(s) or address: devices are made without netlink
    transport: str = "gloo"  # "tcp": ringtrain's TCP mesh carries the ciphertext (enclaves)
    failure: SecurityError | None = None
    job_key: bytes = field(default=b"", repr=False)  # kept for an elastic job's next world

    # Store calls run on daemon threads (waits, group workers): through exit_guard, so
    # none is under way while the interpreter finalizes (that would abort the process).
    def fail(self, error: SecurityError) -> None:
        if self.failure is None:
            self.failure = error
            with exit_guard.native_call() as ok:
                try:
                    if ok:
                        self.notices.set(_NOTICE_KEY, str(error))
                except Exception as e:  # the store may be gone; the local error still stands
                    log.debug("could not post the security failure notice: %s", e)

    def check_notice(self) -> None:
        if self.failure is not None:
            raise SecurityError(str(self.failure))
        with exit_guard.native_call() as ok:
            try:
                if ok and self.notices.check([_NOTICE_KEY]):
                    text = self.notices.get(_NOTICE_KEY).decode(errors="replace")
                    self.failure = SecurityError(text)
            except Exception as e:  # never let the watchdog's own problem mask the real one
                log.debug("could not read the security failure notice: %s", e)
        if self.failure is not None:
            raise SecurityError(str(self.failure))


_context: Context | None = None
_context_lock = threading.Lock()
# Elastic: the job key of the world just abandoned, for the next world of the same job. The
# launcher's key pipe is read once, and its descriptor number may be reused by then.
_kept_key: bytes | None = None


def configure(
    job_key: bytes,
    job_id: str,
    rank: int,
    host: str,
    notices: Store,
    interface: str = "",
    transport: str = "gloo",
) -> Context:
    """Set the key and identity for sealed groups created from now on (one per generation)."""
    global _context
    with _context_lock:
        _context = Context(
            keys.derive(job_key, keys.SEALING),
            job_id,
            rank,
            host,
            notices,
            interface,
            transport,
            job_key=job_key,
        )
        return _context


def join(
    store: dist.Store,
    config: Config,
    env: Mapping[str, str],
    rank: int,
    size: int,
    transport: str = "gloo",
) -> dist.Store:
    """Secure ``ringtrain.init``: load the key, run the authenticated rendezvous, configure the
    sealed backend. Returns the store to build process groups on (under the job's keyed prefix).
    """
    global _kept_key
    key, _kept_key = _kept_key or keys.load_job_key(config, env), None
    host = env.get(Ringtrain.HOSTNAME) or socket.gethostname()
    job_id = env.get(Ringtrain.JOB_ID, "")
    rendezvous.authenticate(store, key, job_id, rank, size, host, config.timeout_s)
    job_store = dist.PrefixStore(rendezvous.job_prefix(key, job_id), store)
    interface = env.get(Torch.GLOO_SOCKET_IFNAME) or config.network_interface
    configure(key, job_id, rank, host, job_store, interface, transport)
    return job_store


def deconfigure(keep_key: bool = False) -> None:
    """Forget the sealing context. ``keep_key``: the next :func:`join` of this process is the
    next world of the same elastic job, and authenticates with the same job key (fresh sealed
    groups and session keys are made all the same)."""
    global _context, _kept_key
    with _context_lock:
        if keep_key and _context is not None:
            _kept_key = _context.job_key
        elif not keep_key:
            _kept_key = None
        _context = None


def _context_for(store: dist.Store, rank: int) -> Context:
    """The configured context; a standalone DDP job (no ringtrain.init) loads the key itself."""
    with _context_lock:
        if _context is not None:
            return _context
    from ringtrain.config import Config

    config = Config.from_env()
    key = keys.load_job_key(config)
    host = environ.current().get(Ringtrain.HOSTNAME) or socket.gethostname()
    transport = tcp_backend.choose(config.transport)
    return configure(
        key, environ.current().get(Ringtrain.JOB_ID, ""), rank, host, store, transport=transport
    )


class SealedProcessGroup(RingProcessGroup):
    """A process group whose every message is sealed. Created by torch via the backend name."""

    backend_name = BACKEND

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
    ) -> None:
        super().__init__(rank, size)
        self._ctx = _context_for(store, rank)
        self._timeout = timeout
        members, randoms = _exchange_randoms(store, self._ctx, rank, size, timeout)
        session = sealing.Session(self._ctx.sealing_key, self._ctx.job_id, rank, members, randoms)
        inner = _inner(store, rank, size, timeout, self._ctx)
        self._begin(Ring(inner, session), f"ringtrain-sealed-{rank}")

    def _poisoned(self) -> BaseException | None:
        failure = self._ctx.failure
        return None if failure is None else SecurityError(str(failure))

    def _check(self) -> None:
        self._ctx.check_notice()

    def _on_error(self, error: BaseException) -> BaseException:
        if isinstance(error, SecurityError):  # poison every sealed group, tell every rank
            self._ctx.fail(error)
            return error
        # A transport failure caused by a peer's security failure is that failure.
        try:
            self._ctx.check_notice()
        except SecurityError as notice:
            return notice
        return error


# The handle type, under its old name.
SealedWork = RingWork


def _exchange_randoms(
    store: dist.Store, ctx: Context, rank: int, size: int, timeout: datetime.timedelta
) -> tuple[list[sealing.Member], list[bytes]]:
    """Every member posts a fresh random value with who it is; all read everyone's."""
    mine = os.urandom(32)
    # torch's binding takes bytes; its stub declares str only.
    store.set(f"sealed/session/{rank}", mine + f"{ctx.rank}\n{ctx.host}".encode())  # type: ignore[arg-type]
    members, randoms = [], []
    for r in range(size):
        raw = (
            mine + f"{ctx.rank}\n{ctx.host}".encode()
            if r == rank
            else store.get(f"sealed/session/{r}")
        )
        rnd, info = bytes(raw[:32]), bytes(raw[32:]).decode(errors="replace")
        grank, _, host = info.partition("\n")
        randoms.append(rnd)
        members.append(sealing.Member(int(grank), host))
    return members, randoms


def _inner(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, ctx: Context
) -> Channel:
    """What carries the ciphertext: ringtrain's TCP mesh (``transport = "tcp"``), or a Gloo
    group. With an interface given, Gloo's devices are made from addresses (one ioctl per name)
    instead of its own interface lookup; Gloo still calls ``getifaddrs()`` when it makes a
    device, which needs netlink, so enclaves (no netlink) need the TCP mesh."""
    if ctx.transport == "tcp":
        return tcp_backend.mesh(dist.PrefixStore("gloo", store), rank, size, timeout)
    store = dist.PrefixStore("gloo", store)
    # Gloo's backend binds send and recv (the Channel the ring uses); torch's stub lacks them.
    if not ctx.interface.strip():
        return cast(Channel, dist.ProcessGroupGloo(store, rank, size, timeout))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [
        dist.ProcessGroupGloo.create_device(hostname=network.address_of(name.strip()))
        for name in ctx.interface.split(",")
        if name.strip()
    ]
    return cast(Channel, dist.ProcessGroupGloo(store, rank, size, opts))


def register() -> None:
    """Make ``ringtrain_sealed`` known to torch.distributed (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def _create(
    store: dist.Store, rank: int, size: int, timeout: datetime.timedelta
) -> SealedProcessGroup:
    return SealedProcessGroup(store, rank, size, timeout)


register()
