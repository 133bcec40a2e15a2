"""WorkerThread threads: one per process group, running blocking collectives in submission order."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable

import torch

from ringtrain.errors import CollectiveAbortedError
from ringtrain.runtime import exit_guard
from ringtrain.runtime.contracts import Group

# A call to run: its future, the function, its arguments.
_Job = tuple["concurrent.futures.Future[object]", Callable[..., object], tuple[object, ...]]


class WorkerThread:
    """One daemon thread running calls in submission order."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ringtrain-reducer", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., object], *args: object) -> concurrent.futures.Future[object]:
        fut: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
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
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as e:  # handed to the waiting thread
                        fut.set_exception(e)
                del fut, fn, args
            if not ok:
                return

    def close(self) -> None:
        self._jobs.put(None)


class SharedWorkers:
    """One :class:`WorkerThread` per process group, shared by every user of that group.

    The ring's sends and receives all use tag 0, and a reducer's or a hierarchical allreduce's
    collectives are numbered by the order they are issued in: two threads issuing on one group
    interleave differently on each rank, and a receive then takes another exchange's message.
    Two optimizers' exchanges (a GAN's, or an overlapped step still on the wire while the next
    model's backward launches) must therefore queue on one thread per group, in submission
    order, which is the main thread's and the same on every rank. The worker ends when the last
    holder releases it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, tuple[WorkerThread, int]] = {}  # id(group): (worker, holders)

    def acquire(self, group: Group) -> WorkerThread:
        with self._lock:
            worker, holders = self._held.get(id(group), (None, 0))
            if worker is None:
                worker = WorkerThread()
            self._held[id(group)] = (worker, holders + 1)
            return worker

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
