"""A Python ``torch.distributed`` process group that runs ringtrain's own ring algorithms.

:class:`RingProcessGroup` maps every ``torch.distributed`` call torch makes on a group
(``all_reduce``, ``broadcast``, ``all_gather``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, ``barrier``, ``send``/``recv``) onto
:class:`ringtrain.transport.ring.Ring`, which runs them over point-to-point messages. Two
backends are built on it: ``ringtrain_sealed`` (:mod:`ringtrain.transport.sealed_backend`, every
message sealed) and ``ringtrain_tcp`` (:mod:`ringtrain.transport.tcp_backend`, plain bytes over
ringtrain's own TCP mesh, for enclaves, where Gloo cannot start).

Each group owns one worker thread that runs its operations in call order and returns a
:class:`RingWork` at once, so ``async_op=True`` overlaps as with Gloo.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ringtrain.errors import CollectiveAbortedError
from ringtrain.runtime import exit_guard
from ringtrain.transport.ring import Ring

# While an operation waits longer than this, it runs its group's check (a peer's failure).
NOTICE_POLL_S = 0.25
# How long shutdown waits for the group's worker to finish its queue.
SHUTDOWN_JOIN_S = 5.0


class RingWork(dist.Work):
    """The handle of one operation; ``wait`` raises its error (a SecurityError intact).

    ``check`` runs every :data:`NOTICE_POLL_S` while waiting: the sealed backend raises a
    peer's posted failure from it."""

    def __init__(self, check: Callable[[], None], result: object) -> None:
        super().__init__()
        self._check = check
        self._result = result
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._future: Future[object] | None = None
        self._lock = threading.Lock()

    def _finish(self, error: BaseException | None, settle: bool = True) -> None:
        """End the operation; ``settle=False`` leaves torch's future (if one was asked for)
        alone: setting it is a torch call."""
        with self._lock:
            self._error = error
            self._done.set()
            fut = self._future
        if fut is not None and settle:
            _settle(fut, self._result, error)

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        limit = timeout.total_seconds() if timeout else 0.0
        deadline = time.monotonic() + limit if limit > 0 else None
        while not self._done.wait(NOTICE_POLL_S):
            self._check()  # a peer's failure ends our wait, with its message
            if deadline is not None and time.monotonic() > deadline:
                # "timed out", as Gloo says: a sliced wait (runtime.abort) waits again.
                raise CollectiveAbortedError(f"a ringtrain operation timed out after {limit:g} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> object:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def get_future(self) -> Future[object]:
        with self._lock:
            if self._future is None:
                self._future = Future()
                if self._done.is_set():
                    _settle(self._future, self._result, self._error)
            return self._future


def _settle(fut: Future[object], result: Any, error: BaseException | None) -> None:
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


class RingProcessGroup(dist.ProcessGroup):
    """A Python process group whose collectives are :class:`Ring`'s, run in one
    worker thread per group. Subclasses build the ring and call :meth:`_begin`."""

    backend_name = ""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the Python-group constructor
        self._closed = False
        self._left: BaseException | None = None  # set by leave(): every later operation fails

    def _begin(self, link: Ring, name: str) -> None:
        """Start serving: ``link`` runs the algorithms; one worker thread runs operations in
        call order (the order point-to-point transports need)."""
        self._link = link
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], RingWork] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # Hooks for the sealed backend: a failure every group of the process must share.
    def _poisoned(self) -> BaseException | None:
        """The failure that ends every operation of this group at once (cheap: no I/O)."""
        return None

    def _check(self) -> None:
        """Raise a failure of another rank, if one was posted (runs while waiting)."""

    def _on_error(self, error: BaseException) -> BaseException:
        """What an operation's error becomes (and what it poisons)."""
        return error

    # ---- plumbing ----------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return self.backend_name

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

    def _submit(self, fn: Callable[[], None], result: object) -> RingWork:
        work = RingWork(self._check, result)
        poisoned = self._left or self._poisoned()
        if poisoned is not None:
            work._finish(poisoned)
        elif self._closed:
            work._finish(CollectiveAbortedError("the process group was shut down"))
        else:
            self._jobs.put((fn, work))
        return work

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, work = job
            del job
            # An operation makes torch calls that release the GIL, and so may freeing what it
            # holds: none may be under way while the interpreter finalizes
            # (runtime.exit_guard); the exit waits for this one.
            with exit_guard.native_call() as ok:
                poisoned = self._left or self._poisoned()
                if not ok:
                    exit_guard.keep(fn, work)  # its future is torch's: not settled either
                    work._finish(CollectiveAbortedError("the process is exiting"), settle=False)
                elif poisoned is not None:
                    work._finish(poisoned)
                else:
                    try:
                        fn()
                    except BaseException as e:  # a peer died, a timeout, a forgery: report, go on
                        work._finish(self._on_error(e))
                    else:
                        work._finish(None)
                del fn, work  # hold no tensor while idle
            if not ok:
                return

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(SHUTDOWN_JOIN_S)
        if self._thread.is_alive():
            exit_guard.leave_behind(self._thread)  # still in torch calls: the exit waits for it
        else:
            # Release the transport now, from this thread: left to interpreter exit, Gloo's
            # destructor runs too late and aborts the process ("terminate called without an
            # active exception"). A worker stuck in Gloo (a peer failed) keeps it until Gloo
            # times out.
            inner = self._link.detach()
            close = getattr(inner, "close", None)
            if close is not None:  # the TCP mesh closes its sockets
                close()

    def leave(self) -> None:
        """Leave this group without waiting for its peers: its world was replaced (an elastic
        job), and a peer of it may be gone or may never take part again.

        Unlike :meth:`shutdown` this never blocks: queued operations fail, a TCP mesh is closed
        at once (so an operation waiting on a peer fails now, not at the timeout), the worker
        stops after the operation under way, and the process's exit waits for it."""
        if self._closed:
            return
        self._closed = True
        self._left = CollectiveAbortedError(
            "a peer failed: this process group's world was replaced (elastic job)"
        )
        self._jobs.put(None)
        close = getattr(self._link.inner, "close", None)
        if close is not None:  # a Gloo group cannot be interrupted; its worker ends at its timeout
            close()
        exit_guard.leave_behind(self._thread)

    def abort(self) -> None:
        self.shutdown()

    # ---- collectives (signatures as torch calls them) ----------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> RingWork:  # type: ignore[override]
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._submit(lambda: _each(tensors, lambda t: self._link.allreduce(t, op)), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> RingWork:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> RingWork:  # type: ignore[override]
        root = opts.rootRank if opts is not None else 0
        return self._submit(
            lambda: _each(tensors, lambda t: self._link.broadcast(t, root)), tensors
        )

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> RingWork:
        def run() -> None:
            for outs, inp in zip(outputs, inputs):
                _staged([*list(outs), inp], lambda *ts: self._link.allgather(ts[:-1], ts[-1]))

        return self._submit(run, outputs)

    def all_gather_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> RingWork:
        def run() -> None:
            def go(out: torch.Tensor, i: torch.Tensor) -> None:
                self._link.allgather(list(out.reshape(-1).chunk(self.size())), i)

            _staged([output, inp], go)

        return self._submit(run, [output])

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def reduce_scatter_single(
        self, output: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> RingWork:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._submit(
            lambda: _staged([output, inp], lambda o, i: self._link.reducescatter(o, i, op)),
            [output],
        )

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> RingWork:
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
    ) -> RingWork:
        n = self.size()

        def split(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
            if not sizes:
                return list(t.chunk(n)) if t.numel() else [t] * n
            return list(torch.split(t, sizes))

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
    ) -> RingWork:
        return self._submit(lambda: self._link.alltoall(outputs, inputs), outputs)

    def run_on_link(self, fn: Callable[[Ring], None]) -> RingWork:
        """Run ``fn(link)`` as one operation of this group, in call order: the engine's
        reduce-scatter (:mod:`ringtrain.transport`), whose ring needs each step's send and
        receive in flight at once, which separate operations of this group would not be."""
        return self._submit(lambda: fn(self._link), None)

    def barrier(self, opts: Any = None) -> RingWork:
        return self._submit(self._link.barrier, None)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> RingWork:
        return self._submit(lambda: _each(tensors, lambda t: self._link.send(t, dst)), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> RingWork:
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
