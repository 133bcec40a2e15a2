"""The in-process writer of :class:`ringtrain.checkpoint.Checkpointer`: a background thread.

Where a rank may not start a process, lock a file or use ``/dev/shm`` (an SGX/Gramine enclave),
the writer process of :mod:`ringtrain.checkpoint.process_writer` cannot run. This writer copies the
rank's tensors into private host buffers (``torch.empty_like(...).copy_()``, made once per key
and reused, as the shared-memory ones are), snapshots the rest of the part (so training may
change it at once), and writes and commits on a thread of the rank's own process, calling the
same :func:`~ringtrain.checkpoint.store.write_part` and :func:`~ringtrain.checkpoint.store.commit`
as the writer process. Its cost: the writing shares the rank's process (and its GIL where the
work is Python), where the writer process runs apart at the lowest priority.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch

from ringtrain.checkpoint import sealed, store
from ringtrain.checkpoint.layout import Item
from ringtrain.checkpoint.store import GIVEN_UP, said


class ThreadWriter:
    """One save at a time: :meth:`host` copies, :meth:`submit` starts the write, :meth:`wait`
    waits for it, :meth:`outcome` takes its ``("ok", path)`` or ``("error", message)``. The
    interface of the process writer."""

    kind = "thread"

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._result: tuple[str, str] | None = None
        # Another writer's host copy (a writer process's shared buffers), used instead of
        # buffers of this one's own while that writer has nothing in flight: a preemption's save
        # beside it then takes no second copy of the state (see Checkpointer._urgent_writer).
        self.lender: Callable[[torch.Tensor, str], torch.Tensor] | None = None

    def host(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """Copy into this key's host buffer: the lender's, else a private one (made once,
        reused by later saves)."""
        if self.lender is not None:
            lent = self._buffers[key] = self.lender(t, key)
            return lent
        src = t.detach()
        got = self._buffers.get(key)
        if got is None or got.shape != src.shape or got.dtype != src.dtype:
            fresh = torch.empty_like(src, device="cpu", memory_format=torch.contiguous_format)
            got = self._buffers[key] = fresh
        got.copy_(src)
        return got

    def ready(self) -> None:
        """Nothing to start: the thread is made per save."""

    def submit(self, job: store.Job, items: list[Item], keys: sealed.Keys | None) -> None:
        # The buffers go as they are (training writes them only at the next save, after this
        # one is done); everything else is copied now, as the process writer's pickle does.
        mine = {id(b): b for b in self._buffers.values()}
        items = copy.deepcopy(items, mine)
        self._result = None
        self._thread = threading.Thread(
            target=self._write, args=(job, items, keys), name="ringtrain-ckpt-writer", daemon=True
        )
        self._thread.start()

    def _write(self, job: store.Job, items: list[Item], keys: sealed.Keys | None) -> None:
        try:
            store.write_part(job, items, keys)
            if job.rank == 0:
                store.commit(job, keys)
            self._result = ("ok", job.final)
        except store.SaveGivenUp as e:  # a rank left: not this writer's failure
            self._result = (GIVEN_UP, str(e))
        except BaseException as e:  # every failure goes back to the training loop
            self._result = ("error", said(e))

    def wait(self, wait_s: float | None) -> bool:
        """Whether the submitted save's outcome is in (or nothing is being written), waited for
        up to ``wait_s`` (None: until it is)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(wait_s)
        return not thread.is_alive()

    def outcome(self) -> tuple[str, str] | None:
        """The submitted save's outcome if it is in; None while it is still being written."""
        thread = self._thread
        if thread is None or thread.is_alive():
            return None
        self._thread = None
        return self._result or ("error", "the writer thread ended without an outcome")

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._buffers.clear()
