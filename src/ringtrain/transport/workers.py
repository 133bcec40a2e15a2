"""WorkerThread threads: one per process group, running blocking collectives in submission order."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar, cast

import torch

from ringtrain.errors import CollectiveAbortedError
from ringtrain.runtime import exit_guard
from ringtrain.runtime.contracts import Group

# A call to run: its future, the function, its arguments.
_Job = tuple["concurrent.futures.Future[object]", Callable[..., object], tuple[object, ...]]
T = TypeVar("T")


class WorkerThread:
    """One daemon thread running calls in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ringtrain-reducer", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """``fn(*args)`` after every call submitted before. Submitted by a call running here
        (an outer exchange's ring steps), it runs at once, in that call's order: queued, it
        would wait behind the call that waits for it."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if threading.current_thread() is self._thread:
            fut.set_running_or_notify_cancel()
            _run_into(cast("concurrent.futures.Future[object]", fut), fn, args)
        else:
            self._jobs.put((cast("concurrent.futures.Future[object]", fut), fn, args))
        return fut

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # gradients are plain data here (grad mode is per thread)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            del job
            # Torch calls that release the GIL, freeing the job's tensors among them: the
            # process's exit waits for the job under way and starts no other
            # (runtime.exit_guard). Idle, the thread holds nothing.
            with exit_guard.native_call() as ok:
                if not ok:
                    exit_guard.keep(fn, args)
                    if fut.set_running_or_notify_cancel():  # nothing waits in vain
                        fut.set_exception(CollectiveAbortedError("the process is exiting"))
                elif fut.set_running_or_notify_cancel():
                    _run_into(fut, fn, args)
                del fut, fn, args
            if not ok:
                return

    def running_here(self) -> bool:
        """Whether the calling thread is this worker's (a job is calling)."""
        return threading.current_thread() is self._thread

    def close(self) -> None:
        self._jobs.put(None)


def _run_into(
    fut: concurrent.futures.Future[object], fn: Callable[..., object], args: tuple[object, ...]
) -> None:
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # handed to the waiting thread
        fut.set_exception(e)


class SharedWorkers:
    """One :class:`WorkerThread` per process group, shared by every user of that group.

    The ring's sends and receives all use tag 0, and a reducer's or a hierarchical allreduce's
    collectives are numbered by the order they are issued in: two threads issuing on one group
    interleave differently on each rank, and a receive then takes another exchange's message.
    Two optimizers' exchanges (a GAN's, or an overlapped step still on the wire while the next
    model's backward launches) must therefore queue on one thread per group, in submission
    order, which is the main thread's and the same on every rank: a job that issues several
    collectives (a local update's outer exchange) is queued whole from the main thread, and
    its collectives run inside it (:meth:`WorkerThread.submit`). The worker ends when the last
    holder releases it.

    The group's own collectives (Gloo's allreduce, all-gather, broadcast, barrier: numbered by
    the order they are issued in, unlike the ring's point-to-point messages) are issued from the
    main thread too, beside the jobs on the worker: a job that issues them and that nobody waits
    for (a local update's link probe, run beside the first round's steps) is noted with
    :meth:`beside`, and every such collective issued on the group from another thread waits
    for those jobs first (:meth:`settle`, which :mod:`~ringtrain.transport.group_ops` calls):
    it follows them on every rank, as it was issued after them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, tuple[WorkerThread, int]] = {}  # id(group): (worker, holders)
        # id(group): the jobs on its worker issuing its collectives that nobody waits for.
        self._beside: dict[int, list[concurrent.futures.Future[object]]] = {}

    def acquire(self, group: Group) -> WorkerThread:
        with self._lock:
            worker, holders = self._held.get(id(group), (None, 0))
            if worker is None:
                worker = WorkerThread()
            self._held[id(group)] = (worker, holders + 1)
            return worker

    def beside(self, group: Group, job: concurrent.futures.Future[T]) -> None:
        """``job`` (queued on ``group``'s worker) issues ``group``'s own collectives and is not
        waited for: :meth:`settle` waits for it until it ends."""
        key = id(group)
        fut = cast("concurrent.futures.Future[object]", job)
        with self._lock:
            self._beside.setdefault(key, []).append(fut)
        fut.add_done_callback(lambda done: self._forget(key, done))

    def _forget(self, key: int, done: concurrent.futures.Future[object]) -> None:
        with self._lock:
            jobs = self._beside.get(key, [])
            if done in jobs:
                jobs.remove(done)
            if not jobs:
                self._beside.pop(key, None)

    def settle(self, group: Group | None) -> None:
        """Before a collective on ``group`` is issued: wait for the jobs :meth:`beside` noted
        on it (their errors are their owners' to raise), unless the caller is a job on the
        group's worker (queued after them, or one of them)."""
        if group is None or not self._beside:  # the usual case: nothing beside, no lock
            return
        key = id(group)
        with self._lock:
            jobs = list(self._beside.get(key, ()))
            worker, _ = self._held.get(key, (None, 0))
        if jobs and not (worker is not None and worker.running_here()):
            concurrent.futures.wait(jobs)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every worker has run what was queued on it so far, at most ``timeout_s``
        in all; whether they did. A process that leaves lets the collectives it started end
        first: an overlapped outer exchange still on the wire is one its peers are running."""
        with self._lock:
            workers = [worker for worker, _ in self._held.values()]
        marks = [worker.submit(lambda: None) for worker in workers]
        _, left = concurrent.futures.wait(marks, timeout=timeout_s)
        return not left

    def release(self, key: int) -> None:
        """``key`` is ``id(group)``: the group lives as long as a holder holds it."""
        with self._lock:
            worker, holders = self._held[key]
            if holders > 1:
                self._held[key] = (worker, holders - 1)
                return
            del self._held[key]
        worker.close()


WORKERS = SharedWorkers()


class Hold:
    """One user's hold on its group's worker in :data:`WORKERS`: taken at the first job (a
    user that never submits starts no thread), given back by :meth:`release` or when the
    holder is collected."""

    def __init__(self, group: Group) -> None:
        self._group = group  # alive while held: the worker is keyed by its id
        self._worker: WorkerThread | None = None
        self._release: weakref.finalize[..., object] | None = None
        self._taking = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        with self._taking:
            if self._worker is None:
                self._worker = WORKERS.acquire(self._group)
                self._release = weakref.finalize(self, WORKERS.release, id(self._group))
            worker = self._worker
        return worker.submit(fn, *args)

    def submit_beside(self, fn: Callable[..., T], *args: object) -> concurrent.futures.Future[T]:
        """:meth:`submit` for a job that issues the group's own collectives and that its caller
        does not wait for now: the group's collectives issued from other threads wait for it
        (:meth:`SharedWorkers.beside`), so they follow it on every rank."""
        job = self.submit(fn, *args)
        WORKERS.beside(self._group, job)
        return job

    def release(self) -> None:
        """Idempotent. A job under way still runs; its own collectives run inside it."""
        if self._release is not None:
            self._release()
