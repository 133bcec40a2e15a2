"""``ringtrain_sealed``: a torch.distributed backend whose traffic is sealed end to end.

Registered with ``torch.distributed.Backend.register_backend``, it is a Python
``ProcessGroup`` that runs :mod:`ringtrain.algorithms.sealed` over a private Gloo group. Any
``torch.distributed`` call on such a group (``all_reduce``, ``broadcast``, ``all_gather``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``barrier``,
``send``/``recv``) is sealed, so ringtrain's controller, executor and engine use it without
knowing, and so does plain DDP::

    import ringtrain.algorithms.sealed_backend   # registers the backend
    dist.init_process_group("ringtrain_sealed", ...)   # key from RINGTRAIN_KEY_FILE / _KEY_FD
    model = DDP(model)

How it runs. Each group owns one worker thread that runs its operations in call order (the order
Gloo needs) and returns a :class:`SealedWork` at once, so ``async_op=True`` overlaps as with Gloo.
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
import fcntl
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ringtrain.algorithms.sealed import Link
from ringtrain.errors import CollectiveAbortedError, ConfigError, SecurityError
from ringtrain.security import keys, rendezvous, sealing

log = logging.getLogger("ringtrain")

BACKEND = "ringtrain_sealed"
# While a sealed operation waits longer than this, it checks the store for a peer's failure.
NOTICE_POLL_S = 0.25
_NOTICE_KEY = "ringtrain_sealed/failure"
# How long shutdown waits for the group's worker to finish its queue.
SHUTDOWN_JOIN_S = 5.0


@dataclass
class Context:
    """What sealed groups of this process need: set by :func:`configure` (ringtrain.init)."""

    sealing_key: bytes
    job_id: str
    rank: int  # global rank
    host: str
    notices: Any  # a store shared by the whole job (this generation), for failure notices
    interface: str = ""  # Gloo's interface(s) or address: devices are made without netlink
    failure: SecurityError | None = None

    def fail(self, error: SecurityError) -> None:
        if self.failure is None:
            self.failure = error
            try:
                self.notices.set(_NOTICE_KEY, str(error))
            except Exception as e:  # the store may be gone; the local error still stands
                log.debug("could not post the security failure notice: %s", e)

    def check_notice(self) -> None:
        if self.failure is not None:
            raise SecurityError(str(self.failure))
        try:
            if self.notices.check([_NOTICE_KEY]):
                text = self.notices.get(_NOTICE_KEY).decode(errors="replace")
                self.failure = SecurityError(text)
        except Exception as e:  # never let the watchdog's own problem mask the real one
            log.debug("could not read the security failure notice: %s", e)
        if self.failure is not None:
            raise SecurityError(str(self.failure))


_context: Context | None = None
_context_lock = threading.Lock()


def configure(
    job_key: bytes, job_id: str, rank: int, host: str, notices: Any, interface: str = ""
) -> Context:
    """Set the key and identity for sealed groups created from now on (one per generation)."""
    global _context
    with _context_lock:
        _context = Context(
            keys.derive(job_key, keys.SEALING), job_id, rank, host, notices, interface
        )
        return _context


def join(store: Any, config: Any, env: Mapping[str, str], rank: int, size: int) -> Any:
    """Secure ``ringtrain.init``: load the key, run the authenticated rendezvous, configure the
    sealed backend. Returns the store to build process groups on (under the job's keyed prefix).
    """
    key = keys.load_job_key(config, env)
    host = env.get("RINGTRAIN_HOSTNAME") or socket.gethostname()
    job_id = env.get("RINGTRAIN_JOB_ID", "")
    rendezvous.authenticate(store, key, job_id, rank, size, host, config.timeout_s)
    job_store = dist.PrefixStore(rendezvous.job_prefix(key, job_id), store)
    interface = env.get("GLOO_SOCKET_IFNAME") or config.network_interface
    configure(key, job_id, rank, host, job_store, interface)
    return job_store


def deconfigure() -> None:
    global _context
    with _context_lock:
        _context = None


def _context_for(store: Any, rank: int) -> Context:
    """The configured context; a standalone DDP job (no ringtrain.init) loads the key itself."""
    with _context_lock:
        if _context is not None:
            return _context
    from ringtrain.config import Config

    key = keys.load_job_key(Config.from_env())
    host = os.environ.get("RINGTRAIN_HOSTNAME") or socket.gethostname()
    return configure(key, os.environ.get("RINGTRAIN_JOB_ID", ""), rank, host, store)


class SealedWork(dist.Work):
    """The handle of one sealed operation; ``wait`` raises its error (SecurityError intact)."""

    def __init__(self, ctx: Context, result: Any) -> None:
        super().__init__()
        self._ctx = ctx
        self._result = result
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: Future[Any] | None = None
        self._lock = threading.Lock()

    def _finish(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            self._done.set()
            fut = self._future
        if fut is not None:
            _settle(fut, self._result, error)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        limit = timeout.total_seconds() if timeout else 0.0
        deadline = time.monotonic() + limit if limit > 0 else None
        while not self._done.wait(NOTICE_POLL_S):
            self._ctx.check_notice()  # a peer's failure ends our wait, with its message
            if deadline is not None and time.monotonic() > deadline:
                raise CollectiveAbortedError(
                    f"a sealed operation did not finish within {limit:g} s"
                )
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Any:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self) -> Future[Any]:
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._done.is_set():
                    _settle(self._future, self._result, self._error)
            return self._future


def _settle(fut: Future[Any], result: Any, error: BaseException | None) -> None:
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


class SealedProcessGroup(dist.ProcessGroup):
    """A process group whose every message is sealed. Created by torch via the backend name."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the Python-group constructor
        self._ctx = _context_for(store, rank)
        self._timeout = timeout
        members, randoms = _exchange_randoms(store, self._ctx, rank, size, timeout)
        session = sealing.Session(self._ctx.sealing_key, self._ctx.job_id, rank, members, randoms)
        inner = _gloo(dist.PrefixStore("gloo", store), rank, size, timeout, self._ctx.interface)
        self._link = Link(inner, session)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], SealedWork] | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        self._thread = threading.Thread(
            target=self._serve, name=f"ringtrain-sealed-{rank}", daemon=True
        )
        self._thread.start()

    # ---- plumbing ----------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    # torch names groups through these; a Python group must keep the names itself.
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "")

    def _submit(self, fn: Callable[[], None], result: Any) -> SealedWork:
        work = SealedWork(self._ctx, result)
        if self._ctx.failure is not None:
            work._finish(SecurityError(str(self._ctx.failure)))
        elif self._closed:
            work._finish(CollectiveAbortedError("the sealed process group was shut down"))
        else:
            self._jobs.put((fn, work))
        return work

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, work = job
            if self._ctx.failure is not None:
                work._finish(SecurityError(str(self._ctx.failure)))
                continue
            try:
                fn()
            except SecurityError as e:
                self._ctx.fail(e)
                work._finish(e)
            except BaseException as e:  # a peer died, or the Gloo timeout: report, keep serving
                work._finish(self._explain(e))
            else:
                work._finish(None)

    def _explain(self, error: BaseException) -> BaseException:
        """A transport failure caused by a peer's security failure is that failure."""
        try:
            self._ctx.check_notice()
        except SecurityError as notice:
            return notice
        return error

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(SHUTDOWN_JOIN_S)
        if not self._thread.is_alive():
            # Release Gloo now, from this thread: left to interpreter exit, its destructor
            # runs too late and aborts the process ("terminate called without an active
            # exception"). A worker stuck in Gloo (a peer failed) keeps it until Gloo times out.
            self._link.inner = None

    def abort(self) -> None:
        self.shutdown()

    # ---- collectives (signatures as torch calls them) ----------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> SealedWork:  # type: ignore[override]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._submit(lambda: _each(tensors, lambda t: self._link.allreduce(t, op)), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> SealedWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> SealedWork:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        return self._submit(
            lambda: _each(tensors, lambda t: self._link.broadcast(t, root)), tensors
        )

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> SealedWork:
        def run() -> None:
            for outs, inp in zip(outputs, inputs):
                _staged([*list(outs), inp], lambda *ts: self._link.allgather(ts[:-1], ts[-1]))

        return self._submit(run, outputs)

    def all_gather_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> SealedWork:
        def run() -> None:
            def go(out: torch.Tensor, i: torch.Tensor) -> None:
                self._link.allgather(list(out.reshape(-1).chunk(self.size())), i)

            _staged([output, inp], go)

        return self._submit(run, [output])

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def reduce_scatter_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> SealedWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._submit(
            lambda: _staged([output, inp], lambda o, i: self._link.reducescatter(o, i, op)),
            [output],
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> SealedWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def run() -> None:
            for out, ins in zip(outputs, inputs):
                flat = torch.cat([t.reshape(-1) for t in ins])
                _staged([out, flat], lambda o, i: self._link.reducescatter(o, i, op))

        return self._submit(run, outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> SealedWork:
        n = self.size()

        def split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
            if not sizes:
                return list(t.chunk(n)) if t.numel() else [t] * n
            return list(t.split(sizes))

        def run() -> None:
            _staged(
                [output, inp],
                lambda o, i: self._link.alltoall(
                    split(o, output_split_sizes), split(i, input_split_sizes)
                ),
            )

        return self._submit(run, [output])

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> SealedWork:
        return self._submit(lambda: self._link.alltoall(outputs, inputs), outputs)

    def barrier(self, opts: Any = None) -> SealedWork:
        return self._submit(self._link.barrier, None)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> SealedWork:
        return self._submit(lambda: _each(tensors, lambda t: self._link.send(t, dst)), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> SealedWork:
        return self._submit(lambda: _each(tensors, lambda t: self._link.recv(t, src)), tensors)


def _each(tensors: list[torch.Tensor], fn: Callable[[torch.Tensor], None]) -> None:
    for t in tensors:
        _staged([t], fn)


def _staged(tensors: list[torch.Tensor], fn: Callable[..., None]) -> None:
    """Run ``fn`` on contiguous CPU copies where needed, then copy results back."""
    work = [
        t if (t.device.type == "cpu" and t.is_contiguous()) else t.detach().cpu().contiguous()
        for t in tensors
    ]
    fn(*work)
    for t, w in zip(tensors, work):
        if w is not t:
            t.copy_(w)


def _exchange_randoms(
    store: Any, ctx: Context, rank: int, size: int, timeout: datetime.timedelta
) -> tuple[list[sealing.Member], list[bytes]]:
    """Every member posts a fresh random value with who it is; all read everyone's."""
    mine = os.urandom(32)
    store.set(f"sealed/session/{rank}", mine + f"{ctx.rank}\n{ctx.host}".encode())
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


def _gloo(store: Any, rank: int, size: int, timeout: datetime.timedelta, interface: str) -> Any:
    """The inner Gloo group. With an interface given, its devices are made from addresses (one
    ioctl per name), because Gloo's own interface lookup enumerates interfaces over netlink,
    which enclave runtimes such as Gramine do not have."""
    if not interface.strip():
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [
        dist.ProcessGroupGloo.create_device(hostname=_address_of(name.strip()))
        for name in interface.split(",")
        if name.strip()
    ]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _address_of(name: str) -> str:
    """An interface's IPv4 address by ``SIOCGIFADDR`` (an address is returned as it is)."""
    try:
        socket.inet_aton(name)
        return name
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError as e:
        raise ConfigError(
            f"network interface {name!r} has no IPv4 address here ({e.strerror}).\n"
            "HINT: check RINGTRAIN_NETWORK_INTERFACE / GLOO_SOCKET_IFNAME on this host."
        ) from e


_SIOCGIFADDR = 0x8915


def register() -> None:
    """Make ``ringtrain_sealed`` known to torch.distributed (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> SealedProcessGroup:
    return SealedProcessGroup(store, rank, size, timeout)


register()
