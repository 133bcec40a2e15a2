"""Run a function on N ranks: the test harness for everything distributed.

A :class:`World` keeps N worker processes alive across tests (importing torch costs seconds, a
test should not pay it), forked from a fork server that imported torch once for the session (a
world of 6 starts in well under a second, not six imports), all attached to a TCPStore that this
process serves on port 0, so parallel test runs never collide on a port. :meth:`World.run` sends
a module-level function to every rank, which runs it between ``ringtrain.init()`` and
``ringtrain.shutdown()`` and sends back the result or the traceback. If the ranks do not answer
in time, every rank's threads are dumped (faulthandler on SIGUSR1) into the error, and the world
is torn down, so a hang becomes a readable failure instead of a stuck CI job. Workers die with
their parent, the fork server (PR_SET_PDEATHSIG), and with this process (a thread that waits
on it: the fork server outlives a test process killed abruptly, see :func:`_die_with`).

Write tests against ``ringtrain.rank()``/``size()`` so the same function passes at any size.

Float kernels differ by CPU (torch picks AVX-512, AVX2 or plain code at a process's first
kernel), so a numerical result can hold on one machine only. ``world(size, capability="avx2")``
is a world whose ranks run the kernels of that ``ATEN_CPU_CAPABILITY`` (:func:`cpu_capability`
says which they got: a CPU without AVX-512 runs AVX2's), so one machine can check several.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import importlib
import multiprocessing as mp
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from ringtrain import environ
from ringtrain.environ import Threads, Torch
from ringtrain.launch import rank_env

DEFAULT_TIMEOUT_S = 60.0
# Starting a rank (spawn, import torch, warm up) is not the test's time: on a loaded machine it
# can take minutes, so it has its own deadline and a test's timeout starts once every rank is up.
START_TIMEOUT_S = 600.0
# (pause, resume) pairs called around a world's start. The test suite stops the running test's
# clock there (tests/conftest.py): the per-test timeout would otherwise count the start, and end
# a test (and, under pytest-xdist, kill its worker) that only waited for torch to import.
start_hooks: list[tuple[Callable[[], None], Callable[[], None]]] = []


class RankFailed(AssertionError):
    """One or more ranks raised; the message holds each rank's traceback."""


class WorldHung(AssertionError):
    """Ranks did not answer in time; the message holds every rank's stack dump."""


@dataclass
class _Call:
    module: str
    qualname: str
    args: tuple[Any, ...]
    env: dict[str, str]
    init: bool
    settings: dict[str, Any]


# What the fork server imports once; every rank is forked from it with these already loaded
# (torch._dynamo is what the first optimizer step would import: see _warm_up).
PRELOAD = ["torch", "torch._dynamo", "ringtrain", "ringtrain.torch"]


def _die_with(pid: int) -> None:
    """End this rank when process ``pid`` (the test process) is gone, whatever the rank is
    doing. PR_SET_PDEATHSIG is not enough: multiprocessing hands every child of the fork server
    the write end of the pipe whose closing ends the fork server, so after a test process killed
    abruptly (a pytest timeout, SIGKILL) the fork server and its ranks keep each other alive."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            os._exit(1)  # gone already
        except OSError:
            return  # no pidfd here (Linux before 5.3): the fork server's end still applies
        select.select([fd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="ringtrain-test-owner-watch", daemon=True).start()


def _worker(
    rank: int,
    size: int,
    port: int,
    conn: Connection,
    sys_path: list[str],
    log_path: str,
    env: dict[str, str],
    owner: int,
) -> None:
    import ctypes
    import faulthandler

    # Die with the parent (the fork server), even if it is SIGKILLed, and with the test process.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    _die_with(owner)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    sys.path[:] = sys_path
    # The environment of the process that made the world, as a spawned child would have it (the
    # fork server's own is that of whoever started it, perhaps long before).
    current = environ.mutable()
    current.clear()
    current.update(env)
    environ.update(rank_env.variables(rank, size, "127.0.0.1", port))
    environ.set_var(Threads.OMP_NUM_THREADS, "1")
    import torch

    torch.set_num_threads(1)
    import ringtrain  # noqa: F401  (imported before the freeze and "ready" below)

    _warm_up(torch)
    # What torch and its imports made lives as long as the rank: out of the collector's sight,
    # a test's gc.collect() (ringtrain.shutdown() runs one) takes milliseconds, not half a second.
    gc.freeze()
    conn.send(("ready", None))
    while True:
        try:
            call: _Call | None = conn.recv()
        except EOFError:
            return
        if call is None:
            return
        saved = {k: environ.current().get(k) for k in call.env}
        environ.update(call.env)
        try:
            answer = _answer(call)
            try:
                conn.send(answer)
            except BaseException as e:  # a result that cannot be pickled
                conn.send(_error(e))
        finally:
            for k, v in saved.items():
                if v is None:
                    environ.pop(k)
                else:
                    environ.set_var(k, v)


def _answer(call: _Call) -> tuple[str, Any]:
    """One call on this rank: ``("ok", result)`` or ``("error", what it raised)``."""
    import ringtrain

    try:
        fn: Any = importlib.import_module(call.module)
        for part in call.qualname.split("."):
            fn = getattr(fn, part)
        if call.init:
            ringtrain.init(**call.settings)
    except BaseException as e:
        return _error(e)
    try:
        answer = ("ok", fn(*call.args))
    except BaseException as e:  # report everything, including assertion failures
        answer = _error(e)
    # After the except block, not in a finally: a shutdown() while an exception is handled is
    # a failing rank's (its groups left undestroyed); a test world's ranks serve the next call,
    # so they leave as a rank whose script ended.
    if call.init:
        try:
            ringtrain.shutdown()
        except BaseException as e:
            answer = answer if answer[0] == "error" else _error(e)
    return answer


def _error(e: BaseException) -> tuple[str, str]:
    return ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")


def _warm_up(torch: Any) -> None:
    """Pay torch's lazy imports now: the first optimizer step imports torch._dynamo (and sympy),
    which can take longer than a test's whole timeout on a busy machine."""
    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.zeros(1)
    torch.optim.Adam([p]).step()


def _context() -> Any:
    """Ranks are forked from a fork server: a clean single-threaded process that imported torch
    once (PRELOAD), so each rank starts in milliseconds instead of importing torch itself. The
    server is this process's one (``ringtrain.bench`` uses it too; whichever starts it first
    chooses its preload, and a rank imports whatever is missing itself)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class World:
    """N long-lived ranks that run test functions on demand.

    ``env``: variables every rank starts with, set before its first torch kernel runs (the
    ranks' warm-up runs one), such as ``ATEN_CPU_CAPABILITY``; ``run(env=...)`` comes too late
    for those.
    """

    def __init__(self, size: int, env: Mapping[str, str] | None = None) -> None:
        import torch.distributed as dist

        self.size = size
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=60),
            wait_for_workers=False,
        )
        self.port = self._store.port
        self._dir = tempfile.TemporaryDirectory(prefix=f"ringtrain-world{size}-")
        ctx = _context()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self.logs = [os.path.join(self._dir.name, f"rank{r}.log") for r in range(size)]
        for r in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(
                    r,
                    size,
                    self.port,
                    child,
                    list(sys.path),
                    self.logs[r],
                    {**environ.current(), **(env or {})},
                    os.getpid(),
                ),
                name=f"ringtrain-test-rank{r}",
                daemon=True,
            )
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._started = False

    def _wait_started(self) -> None:
        hooks = list(start_hooks)
        for pause, _ in hooks:
            pause()
        try:
            self._wait_ranks_up()
        finally:
            for _, resume in hooks:
                resume()

    def _wait_ranks_up(self) -> None:
        waiting = dict(enumerate(self._conns))
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            ready = wait(list(waiting.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorldHung(self._hang_report(sorted(waiting), START_TIMEOUT_S))
            for r, conn in list(waiting.items()):
                if conn in ready:
                    try:
                        conn.recv()
                    except EOFError:
                        raise RankFailed(f"rank {r} died while starting\n{self._tail(r)}") from None
                    del waiting[r]
        self._started = True

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = DEFAULT_TIMEOUT_S,
        env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        init: bool = True,
        **settings: Any,
    ) -> list[Any]:
        """Run ``fn(*args)`` on every rank; returns the per-rank results in rank order.

        ``env`` is applied during the call (one mapping for all ranks, or one per rank);
        ``settings`` go to ``ringtrain.init``. Raises :class:`RankFailed` or :class:`WorldHung`.
        """
        if not self.alive:
            raise WorldHung("the world's processes are gone (an earlier test killed them)")
        if not self._started:
            self._wait_started()
        envs = (
            [dict(e) for e in env] if isinstance(env, Sequence) else [dict(env or {})] * self.size
        )
        for r, conn in enumerate(self._conns):
            conn.send(_Call(fn.__module__, fn.__qualname__, args, envs[r], init, settings))
        results: list[Any] = [None] * self.size
        errors: dict[int, str] = {}
        waiting = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while waiting:
            ready = wait(list(waiting.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorldHung(self._hang_report(sorted(waiting), timeout))
            for r, conn in list(waiting.items()):
                if conn in ready:
                    try:
                        status, value = conn.recv()
                    except EOFError:
                        self._procs[r].join(1)
                        status, value = "error", f"rank {r} died{self._death(r)}\n{self._tail(r)}"
                    del waiting[r]
                    if status == "ok":
                        results[r] = value
                    else:
                        errors[r] = value
        if errors:
            raise RankFailed(
                "\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
            )
        return results

    def _death(self, rank: int) -> str:
        """How a rank that stopped answering ended: its exit code or signal, and a fatal
        error's first line (faulthandler's header, which a long thread dump pushes out of the
        tail); "" while it still runs."""
        code = self._procs[rank].exitcode
        if code is None:
            return ""
        how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
        try:
            with open(self.logs[rank], errors="replace") as f:
                fatal = [line.strip() for line in f if line.startswith("Fatal Python error")]
        except OSError:
            fatal = []
        return f" ({how}{': ' + fatal[-1] if fatal else ''})"

    def _tail(self, rank: int, lines: int = 60) -> str:
        try:
            with open(self.logs[rank], errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def _hang_report(self, missing: list[int], timeout: float) -> str:
        for p in self._procs:
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)
        parts = [f"ranks {missing} did not finish within {timeout:g} s; stacks of every rank:"]
        parts += [f"--- rank {r} ---\n{self._tail(r, 120)}" for r in range(self.size)]
        self.close()
        return "\n".join(parts)

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(2)
        for conn in self._conns:
            conn.close()
        self._dir.cleanup()


# ATen's CPU capabilities on x86 (ATEN_CPU_CAPABILITY's values), plainest first.
CAPABILITIES = ("default", "avx2", "avx512")
# Shared worlds by (size, ATEN_CPU_CAPABILITY; None: the CPU's own choice).
_worlds: dict[tuple[int, str | None], World] = {}


def world(size: int, capability: str | None = None) -> World:
    """A shared world of ``size`` ranks, (re)started on demand; ``capability`` (``"default"``,
    ``"avx2"``, ``"avx512"``): one whose ranks run that ATen CPU capability's kernels."""
    key = (size, capability)
    w = _worlds.get(key)
    if w is None or not w.alive:
        if w is not None:
            w.close()
        env = {} if capability is None else {Torch.ATEN_CPU_CAPABILITY: capability}
        w = _worlds[key] = World(size, env)
    return w


def capability_world(size: int, capability: str) -> World | None:
    """A shared world of ``size`` ranks running ``capability``'s kernels: the plain one where
    that is the CPU's own choice, else one of its own; None where this CPU lacks it (torch would
    run another's kernels, or die of SIGILL at an AVX-512 one)."""
    if not _cpu_runs(capability):
        return None
    wanted = [capability.upper()] * size
    plain = world(size)
    if plain.run(cpu_capability, init=False) == wanted:
        return plain
    w = world(size, capability)
    return w if w.run(cpu_capability, init=False) == wanted else None


def _cpu_runs(capability: str) -> bool:
    """Whether this CPU has the instructions of ``capability``'s kernels: torch takes
    ATEN_CPU_CAPABILITY=avx512 on a CPU without AVX-512 and dies of SIGILL at its first such
    kernel, so ask which one torch picks by itself, and allow it and those below it."""
    best = _own_capability().lower()
    if best not in CAPABILITIES:  # not x86 (NEON, SVE...): only the plain kernels are shared
        return capability == "default"
    return CAPABILITIES.index(capability) <= CAPABILITIES.index(best)


@functools.cache
def _own_capability() -> str:
    """The capability torch picks on this CPU with ATEN_CPU_CAPABILITY unset (a child process:
    a process reads the variable once, at its first kernel)."""
    env = {k: v for k, v in environ.current().items() if k != Torch.ATEN_CPU_CAPABILITY}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout.strip()


def cpu_capability() -> str:
    """The ATen CPU capability this process's kernels use (``"AVX512"``, ``"AVX2"``,
    ``"DEFAULT"``...): run it on a world's ranks with ``init=False``."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def close_all() -> None:
    for w in _worlds.values():
        w.close()
    _worlds.clear()


def close(size: int) -> None:
    """Stop the shared worlds of ``size`` ranks if they run: a module that alone needs a larger
    world frees its processes when done instead of holding them for the rest of the session."""
    for key in [k for k in _worlds if k[0] == size]:
        _worlds.pop(key).close()
