"""The process writer: a process of the rank's own that writes its part of each save (and, on
rank 0, commits it) from shared-memory buffers, while training goes on.

:class:`ProcessWriter` copies the part into buffers in ``/dev/shm`` (or
``RINGTRAIN_CHECKPOINT_BUFFERS``; made at the first save and reused, their space claimed when
made) and hands them to :func:`main`, a fresh interpreter (not a thread: serializing, hashing,
sealing and writing would hold the GIL against the training loop), which keeps them mapped
between saves. It runs at the lowest CPU priority (nice +19) and the lowest best-effort I/O
priority, on one thread, so that on a busy host it takes what training leaves. Buffers of a
process killed before it freed them are removed by the next writer (an owner lock, ``flock``,
tells the dead from the living). :class:`~ringtrain.checkpoint.writer.Checkpointer` drives it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import psutil
import torch

from ringtrain import environ
from ringtrain.checkpoint import store
from ringtrain.checkpoint.store import GIVEN_UP, said
from ringtrain.environ import Process
from ringtrain.errors import CheckpointError

_MAIN = "from ringtrain.checkpoint.process_writer import main; main()"
# The writer's niceness above training's: the weakest share of a contended core (about 1.5% of
# what a training process gets), yet it still progresses (a save that finds it unfinished
# waits). On a quiet 2-core host, steps during a write were 1.21x slower at +10 and 1.05-1.15x
# (four runs, median 1.06x) at +19 (docs/checkpoint.md, "Costs").
NICE = 19
_PIPE_BYTES = 1 << 20


_SHM_PREFIX = "ringtrain-ckpt-"
_OWNER = ".owner"  # in each buffer directory: locked (flock) by its process while it lives


def _buffer_dir(where: str) -> tuple[str, int]:
    """A directory under ``where`` ("": /dev/shm) for this process's shared-memory buffers and
    the descriptor holding its owner lock. Removes first the directories whose owner died
    without cleaning up (kill -9): shared memory outlives its processes, and each holds a copy
    of a rank's checkpoint part."""
    if not where:
        where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"cannot make the checkpoint buffers' directory {where!r}: {e}\n"
            "HINT: set RINGTRAIN_CHECKPOINT_BUFFERS to a writable directory on this host."
        ) from e
    _sweep(where)
    path = tempfile.mkdtemp(prefix=_SHM_PREFIX, dir=where)
    tmp = os.path.join(path, _OWNER + ".tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(tmp, os.path.join(path, _OWNER))  # a sweeper sees the lock only once it is held
    return path, fd


def _sweep(where: str) -> None:
    """Remove the buffer directories under ``where`` whose owner lock nobody holds."""
    try:
        names = [n for n in os.listdir(where) if n.startswith(_SHM_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        try:
            fd = os.open(os.path.join(path, _OWNER), os.O_RDWR | os.O_CLOEXEC)
        except OSError:  # being made now, another user's, or gone
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner lives
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


def _reserved(path: str, nbytes: int) -> None:
    """Make the buffer file and claim its space now. A sparse file on a full tmpfs (Docker
    gives /dev/shm 64 MiB) is found full only when a page is first written through the
    mapping, and that write kills the rank with SIGBUS, saying nothing."""
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return  # a file system that cannot reserve: written as before
        os.remove(path)
        where = os.path.dirname(os.path.dirname(path))
        free = shutil.disk_usage(where).free / 2**20
        raise CheckpointError(
            f"no room for this rank's checkpoint buffer in {where}: it needs "
            f"{nbytes / 2**20:.1f} MiB, {free:.1f} MiB are free ({e.strerror})\n"
            f"HINT: give {where} room for a "
            "copy of each rank's part on this host (docker run --shm-size; on Kubernetes an "
            "emptyDir of medium Memory at /dev/shm), or set RINGTRAIN_CHECKPOINT_BUFFERS to a "
            "directory on a local disk, or RINGTRAIN_CHECKPOINT_WRITER=thread (private memory)."
        ) from e
    finally:
        os.close(fd)


def _yield_to_training() -> None:
    """Lower this (writer) process's CPU and I/O priority, and keep it to one thread."""
    with contextlib.suppress(OSError):
        os.nice(NICE)
    with contextlib.suppress(OSError, AttributeError, psutil.Error):  # ionice: Linux only
        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, 7)
    torch.set_num_threads(1)


@dataclass(frozen=True)
class _Shared:
    """A tensor in a shared-memory file: what travels to the writer instead of its bytes."""

    path: str
    dtype: str
    shape: tuple[int, ...]

    def open(self) -> torch.Tensor:
        n = 1
        for d in self.shape:
            n *= d
        dtype = getattr(torch, self.dtype)
        if n == 0:
            return torch.empty(self.shape, dtype=dtype)
        return torch.from_file(self.path, shared=True, size=n, dtype=dtype).view(self.shape)


def _tensor_from(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    """A tensor back from :class:`_Pickler`'s bytes (writable: the bytes are its own)."""
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    """Plain CPU tensors (the optimizer's ``step`` values, RNG states) as their raw bytes:
    torch's own pickling goes through ``torch.save`` per tensor, a third of a millisecond each,
    which the training process would pay for every parameter at every save."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is torch.Tensor
            and obj.device.type == "cpu"
            and obj.layout == torch.strided
            and not obj.requires_grad
            and not obj.is_quantized
        ):
            t = obj.resolve_conj().resolve_neg().contiguous().reshape(-1)
            data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            return _tensor_from, (str(obj.dtype).replace("torch.", ""), tuple(obj.shape), data)
        return NotImplemented


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _widen(fd: int) -> None:
    """Let the pipe to the writer hold a whole save's message, so handing it over never waits
    for the (low-priority) writer to be scheduled and read."""
    with contextlib.suppress(OSError, AttributeError):  # Linux only; capped by pipe-max-size
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)


_COMMITS = "commits"  # the writer's flag: its rank commits (rank 0)


def preload(flags: list[str]) -> None:
    """What the writer imports before it lowers its priority. A committing writer needs DCP
    (``layout.build_metadata``): imported later, at niceness +19, a busy host would give its
    second of CPU minutes. The others never need it."""
    if _COMMITS in flags:
        import torch.distributed.checkpoint.filesystem  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    """The writer process: write each part it is given; rank 0's writer also commits."""
    import ctypes
    import signal

    with contextlib.suppress(OSError):  # die with the training process
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # Ctrl-C and a preemption's SIGTERM reach the rank's whole process group: the rank decides
    # (a durable job waits for the save in flight within the grace period); this process ends
    # when told, or with the rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else argv
    preload(args[2:])
    _yield_to_training()
    rx = Connection(int(args[0]), writable=False)
    tx = Connection(int(args[1]), readable=False)
    mapped: dict[_Shared, torch.Tensor] = {}  # buffers stay mapped from one save to the next
    while True:
        try:
            msg = pickle.loads(rx.recv_bytes())
        except EOFError:
            msg = None
        if msg is None:
            # Every write is closed and answered by now. Skip the interpreter's teardown (torch's
            # included): at niceness +19 on a busy host it can take tens of seconds.
            os._exit(0)
        job, items, keys = msg
        try:
            used = {}
            for it in items:
                if isinstance(it.value, _Shared):
                    got = mapped.get(it.value)
                    used[it.value] = it.value.open() if got is None else got
                    it.value = used[it.value]
            mapped = used  # a buffer the training process replaced is let go
            store.write_part(job, items, keys)
            if job.rank == 0:
                store.commit(job, keys)
            reply = ("ok", job.final)
        except store.SaveGivenUp as e:  # a rank left: not this writer's failure
            reply = (GIVEN_UP, str(e))
        except BaseException as e:  # every failure goes back to the training process
            reply = ("error", said(e))
        del items
        tx.send_bytes(pickle.dumps(reply))


class ProcessWriter:
    """The writer process and its shared-memory buffers (the interface of
    :class:`~ringtrain.checkpoint.thread_writer.ThreadWriter`)."""

    kind = "process"

    def __init__(self, commits: bool = False, buffers: str = "") -> None:
        self._commits = commits  # rank 0's: its process imports DCP at once (see preload)
        self._where = buffers  # the buffers' parent directory ("": /dev/shm)
        self._buffers: dict[str, tuple[_Shared, torch.Tensor]] = {}
        self._made = 0  # buffer files made: each a new name, so the writer's mappings stay true
        self._proc: subprocess.Popen[bytes] | None = None
        self._tx: Any = None
        self._rx: Any = None
        self.shm: str | None = None  # the shared-memory files' directory
        self._shm_lock: int | None = None  # its owner lock (see _buffer_dir)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def ready(self) -> None:
        """A fresh interpreter (not multiprocessing: the training process may itself be a
        daemonic multiprocessing child, which may not have children of its kind)."""
        if self._alive():
            return
        self._stop()
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        env = dict(environ.current())
        env[Process.PYTHONPATH] = os.pathsep.join(p for p in sys.path if p)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _MAIN, str(r1), str(w2)]
                + ([_COMMITS] if self._commits else []),
                pass_fds=(r1, w2),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(r1)
            os.close(w2)
        _widen(w1)
        self._tx = Connection(w1, readable=False)
        self._rx = Connection(r2, writable=False)

    def _alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def submit(self, job: store.Job, items: list[Any], keys: Any) -> None:
        self._tx.send_bytes(_dumps((job, items, keys)))

    def wait(self, wait_s: float | None) -> bool:
        """Whether the submitted save's outcome is in (or the writer ended), waited for up to
        ``wait_s`` (None: until it is). Interruptible: :meth:`outcome` takes it."""
        return bool(self._rx.poll(wait_s)) or not self._alive()

    def outcome(self) -> tuple[str, str] | None:
        """The submitted save's outcome if it is in (a reply is one short write: it reads at
        once); None while the save is still being written."""
        if not self._rx.poll(0) and self._alive():
            return None
        try:
            status, value = pickle.loads(self._rx.recv_bytes())
        except (EOFError, OSError):
            code = self._proc.wait() if self._proc is not None else None
            self._stop()
            return "error", f"the writer process died (exit code {code})"
        return status, value

    def _stop(self, at_once: bool = False) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(OSError):
            self._tx.send_bytes(pickle.dumps(None))
        try:  # at once: nothing in flight, and no time to wait for a niced process's turn
            self._proc.wait(0 if at_once else 10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            # A niced process on a busy host may need a while to be scheduled and die; it dies
            # with this process in any case (PR_SET_PDEATHSIG), so closing never fails on it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(1 if at_once else 30)
        self._tx.close()
        self._rx.close()
        self._proc = None

    def close(self, at_once: bool = False) -> None:
        """Stop the writer process (``at_once``: kill it; nothing may be in flight) and free
        the buffers."""
        try:
            self._stop(at_once)
        finally:
            self._buffers.clear()
            if self.shm is not None:
                shutil.rmtree(self.shm, ignore_errors=True)
                self.shm = None
            if self._shm_lock is not None:
                os.close(self._shm_lock)
                self._shm_lock = None

    def host(self, t: torch.Tensor, key: str) -> _Shared:
        """Copy into this key's shared-memory buffer (made once, reused by later saves)."""
        src = t.detach()
        dtype = str(src.dtype).replace("torch.", "")
        got = self._buffers.get(key)
        if got is None or got[1].shape != src.shape or got[1].dtype != src.dtype:
            if self.shm is None:
                self.shm, self._shm_lock = _buffer_dir(self._where)
            if got is not None:  # the writer maps it until its next save: unlinking is safe
                with contextlib.suppress(OSError):
                    os.remove(got[0].path)
            shared = _Shared(os.path.join(self.shm, str(self._made)), dtype, tuple(src.shape))
            self._made += 1
            _reserved(shared.path, src.numel() * src.element_size())
            got = self._buffers[key] = (shared, shared.open())
        got[1].copy_(src)
        return got[0]

    def lend(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """:meth:`host`, for another writer of this rank: the buffer itself, mapped here."""
        self.host(t, key)
        return self._buffers[key][1]
