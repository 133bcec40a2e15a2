"""Asynchronous saves: training waits only while its tensors are copied to host memory.

:class:`Checkpointer` copies this rank's part into shared-memory buffers (allocated at the
first save and reused, so later saves do not allocate), then hands them to a writer process of
its own (a process, not a thread: serializing, hashing, sealing and writing would otherwise
hold the GIL against the training loop), and returns. Nothing in that blocking part waits for
other ranks after a world's first save: the save id is a prefix agreed at that first save and a
count of saves. The writer streams the part to disk (hashing, and sealing, as it goes) from
buffers it keeps mapped between saves; rank 0's writer then commits the checkpoint
(:mod:`ringtrain.checkpoint.store`). One save is in flight
at a time: a save while the previous one still writes first waits for it (that wait is
blocked time, reported by :attr:`Checkpointer.last_blocked_s`). A write that failed is raised
as :class:`CheckpointError` at the next :meth:`Checkpointer.save`, :meth:`~Checkpointer.check`
or :meth:`~Checkpointer.wait`; a writer process that died is such a failure too. The writer
runs at the lowest CPU priority (nice +19) and the lowest best-effort I/O priority, on one thread,
so that on a busy host it takes what training leaves rather than slowing its steps.

Where no process may be started and there is no ``/dev/shm`` (enclaves), the writer is a thread
of the rank's own process instead (:mod:`ringtrain.checkpoint.thread_writer`), with the same
semantics; ``Checkpointer(writer=...)`` and the ``checkpoint_writer`` setting choose.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import io
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import psutil
import torch

from ringtrain import environ
from ringtrain.checkpoint import api, manifest, peers, store
from ringtrain.checkpoint.thread_writer import GIVEN_UP, ThreadWriter, said
from ringtrain.config import CHECKPOINT_WRITERS
from ringtrain.environ import Process
from ringtrain.errors import CheckpointError, ConfigError

log = logging.getLogger("ringtrain")

_MAIN = "from ringtrain.checkpoint.writer import main; main()"
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


class _ProcessWriter:
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

    def outcome(self, wait_s: float | None) -> tuple[str, str] | None:
        """The submitted save's outcome, waited for up to ``wait_s`` (None: until it comes);
        None while it is still being written."""
        if wait_s is not None and not self._rx.poll(wait_s) and self._alive():
            return None
        try:
            status, value = pickle.loads(self._rx.recv_bytes())
        except (EOFError, OSError):
            code = self._proc.wait() if self._proc is not None else None
            self._stop()
            return "error", f"the writer process died (exit code {code})"
        return status, value

    def _stop(self) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(OSError):
            self._tx.send_bytes(pickle.dumps(None))
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            # A niced process on a busy host may need a while to be scheduled and die; it dies
            # with this process in any case (PR_SET_PDEATHSIG), so closing never fails on it.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(30)
        self._tx.close()
        self._rx.close()
        self._proc = None

    def close(self) -> None:
        """Stop the writer process and free the buffers."""
        try:
            self._stop()
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


class Checkpointer:
    """Periodic asynchronous checkpoints into ``root`` (``root/step-N``), keeping the newest
    ``keep`` (0: all) of its run. Collective like :func:`ringtrain.checkpoint.save`.

    Its checkpoints record a run id: ``run``, or else the id agreed at its first save. Keep-last
    counts and removes only that run's checkpoints, and a save never replaces another run's
    checkpoint of the same step (it fails instead): other checkpoints in ``root`` are left as
    they are. To continue a run loaded from ``root``, pass ``run=restored.run``.

    ``writer``: ``"process"`` (a writer process, shared-memory buffers), ``"thread"`` (a thread
    of this process, private buffers: for enclaves), or ``"auto"``: the thread where this rank's
    collectives run on ringtrain's TCP transport, else the process (decided at the first save).
    None: the job's ``checkpoint_writer`` setting (``RINGTRAIN_CHECKPOINT_WRITER``)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep: int = 0,
        run: str | None = None,
        writer: str | None = None,
    ) -> None:
        self.root = os.fspath(root)
        self.keep = keep
        self.run = run
        self.writer = api._where()[2].checkpoint_writer if writer is None else writer
        if self.writer not in CHECKPOINT_WRITERS:
            raise ConfigError(
                f"writer must be one of {', '.join(CHECKPOINT_WRITERS)}, got {self.writer!r}"
            )
        self._writer: _ProcessWriter | ThreadWriter | None = None
        self._token: str | None = None  # this world's save-id prefix (agreed once per world)
        self._world: tuple[int, int] | None = None
        self._saves = 0  # saves in this world: the same count on every rank
        self._inflight: str | None = None  # the checkpoint being written
        self._lookout: peers.Lookout | None = None  # rank 0: for its peers that left meanwhile
        self._failure: str | None = None
        self.last_blocked_s = 0.0
        self.last_phases: dict[str, float] = {}  # where last_blocked_s went (seconds)
        self.last_committed: str | None = None

    # ---- the writer ----------------------------------------------------------------------------

    @property
    def buffer_dir(self) -> str | None:
        """The shared-memory buffers' directory (made at the first save; process writer)."""
        return self._writer.shm if isinstance(self._writer, _ProcessWriter) else None

    @property
    def writer_pid(self) -> int | None:
        return self._writer.pid if isinstance(self._writer, _ProcessWriter) else None

    @property
    def writer_kind(self) -> str | None:
        """``"process"`` or ``"thread"``: the writer chosen at the first save."""
        return self._writer.kind if self._writer is not None else None

    def _made_writer(self) -> _ProcessWriter | ThreadWriter:
        """The writer, chosen once (at the first save: ``auto`` needs the running job)."""
        if self._writer is not None:
            return self._writer
        kind, why = self.writer, "asked for"
        if kind == "auto":
            from ringtrain.transport import tcp_backend

            tcp = tcp_backend.configured()
            kind = "thread" if tcp else "process"
            why = (
                "auto: this rank's collectives run on ringtrain's TCP transport, as in enclaves, "
                "where no process may start"
                if tcp
                else "auto: a low-priority process keeps the training steps fast"
            )
        log.info("checkpoints into %s: the %s writer (%s)", self.root, kind, why)
        # Rank 0 commits (a rank 0 of a later elastic world imports DCP at its first commit).
        rank, _, cfg = api._where()
        self._writer = (
            ThreadWriter()
            if kind == "thread"
            else _ProcessWriter(commits=rank == 0, buffers=cfg.checkpoint_buffers)
        )
        _unclosed.add(self)
        return self._writer

    def _collect(self, block: bool) -> None:
        """Take the in-flight save's outcome, if it is known (or wait for it). Rank 0 meanwhile
        notes the peers that left, whose parts its writer would wait for until the timeout."""
        if self._inflight is None or self._writer is None:
            return
        lookout = self._lookout if block else None  # not in check(): no reads per step
        got = self._writer.outcome(None if block and lookout is None else 0.0)
        while got is None and lookout is not None:
            lookout.look()
            got = self._writer.outcome(peers.EVERY_S)
        if got is None:
            return
        final, self._inflight, self._lookout = self._inflight, None, None
        status, value = got
        if status == "ok":
            self.last_committed = value
        elif status == GIVEN_UP:  # said, not raised: the peer's departure is the failure
            log.warning("ringtrain: %s", value)
        else:
            self._failure = f"the background save into {final} failed: {value}"

    def check(self) -> None:
        """Raise the failure of an earlier background save, if one failed (once)."""
        self._collect(block=False)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            if "\nHINT:" in failure:  # the writer's own error says what to do
                raise CheckpointError(failure)
            raise CheckpointError(
                f"{failure}\nHINT: earlier checkpoints are untouched; fix the cause (space, "
                "permissions) and save again."
            )

    def in_flight(self) -> bool:
        """Whether a background save is still being written (does not raise its failure)."""
        self._collect(block=False)
        return self._inflight is not None

    def wait(self) -> str | None:
        """Wait for the save in flight; returns the newest committed checkpoint's path."""
        self._collect(block=True)
        self.check()
        return self.last_committed

    def close(self) -> None:
        """Wait for the save in flight, then stop the writer and free the buffers."""
        try:
            self.wait()
        finally:
            _unclosed.discard(self)
            if self._writer is not None:
                self._writer.close()

    # ---- saving ------------------------------------------------------------------------------

    def _save_id(self) -> str:
        """This save's id, the same on every rank without a collective in the blocking part:
        a random prefix agreed once per world (at its first save, which also checks that the
        ranks' roots are the same), then a count of saves.
        Ranks that disagree (one skipped a save) write parts under different ids, which the
        committing writer never mixes: the save fails, named, at the next save."""
        world = api.world()
        if self._token is None or self._world != world:
            self._token, self._world, self._saves = api.new_token(self.root), world, 0
            if self.run is None:  # the run is this object's, across elastic re-formings
                self.run = self._token
        self._saves += 1
        return f"{self._token}-{self._saves}"

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: object = None,
        extra: object = None,
    ) -> None:
        """Start saving ``root/step-<step>``: returns once this rank's part is in host memory.
        Raises the failure of the previous background save, if it failed."""
        t0 = time.perf_counter()
        self._collect(block=True)  # one save in flight: the previous one must be done
        self.check()
        writer = self._made_writer()
        writer.ready()
        t1, c1 = time.perf_counter(), time.process_time()
        save_id = self._save_id()
        final = os.path.join(self.root, manifest.step_name(step))
        job, items, keys = api.prepare(
            final, step, self.keep, model, optimizer, sampler, extra, writer.host, save_id, self.run
        )
        t2, c2 = time.perf_counter(), time.process_time()
        writer.submit(job, items, keys)
        self._inflight, self._lookout = final, peers.Lookout.of(job)
        t3 = time.perf_counter()
        self.last_blocked_s = t3 - t0
        self.last_phases = {
            "previous": t1 - t0,
            "copy": t2 - t1,
            "copy_cpu": c2 - c1,  # CPU time (all threads): the work, not the load
            "handoff": t3 - t2,
        }

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Checkpointers with a writer that were not closed. A script that saves at its last step and
# ends without close() (no ``with``) lost that save: the writer process died with the rank
# (PR_SET_PDEATHSIG), the writer thread is a daemon, and the exit code was 0.
_unclosed: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


def _close_at_exit() -> None:
    """atexit: close every Checkpointer left open, so the save in flight commits (as Python
    waits for a ThreadPoolExecutor's work) and its buffers are freed. Not in a rank that is
    failing (an uncaught exception): it leaves at once with its own exit code."""
    from ringtrain.runtime import departures  # not at import: the writer process imports this

    if departures.failure() is not None:
        return
    for saver in list(_unclosed):
        try:
            if saver.in_flight():
                log.info("ringtrain: waiting for the save into %s at exit", saver._inflight)
            saver.close()
        except Exception as e:  # nobody is left to raise to: say it where the job's output is
            sys.stderr.write(f"ringtrain: at exit: {e}\n")


atexit.register(_close_at_exit)
