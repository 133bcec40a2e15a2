"""Where a benchmark's ranks come from: spawned here on this machine, or already started by a launcher.

``ringtrain bench allreduce -np 2`` starts its own ranks: child processes attached to a TCPStore
that this process serves on port 0 (so concurrent runs never collide on a port), which die with
it. When this process was itself started as one rank of a job (``ringtrain run``, torchrun,
mpirun, Slurm: any launcher :mod:`ringtrain.runtime.environment` recognizes), the benchmark runs
in place on the existing ranks instead, so the same command measures a multi-host job.

Either way a benchmark is a module-level function ``fn(params) -> result`` run on every rank
between ``ringtrain.init()`` and ``ringtrain.shutdown()``; rank 0's result comes back.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from ringtrain import environ
from ringtrain.environ import Threads
from ringtrain.errors import CollectiveAbortedError, ConfigError, LaunchError
from ringtrain.launch import rank_env
from ringtrain.runtime import environment

P = TypeVar("P")
R = TypeVar("R")


def placement() -> environment.Placement:
    """This process's place as its launcher describes it; launcher 'single' when there is none."""
    return environment.detect(environ.current())


def under_launcher() -> bool:
    return placement().launcher != "single"


def run(
    fn: Callable[[P], R],
    params: P,
    *,
    np: int | None,
    threads: int | None,
    settings: Mapping[str, Any],
    timeout_s: float,
) -> R | None:
    """Run ``fn(params)`` on every rank; rank 0's result, or None on the other ranks in place.

    ``np`` is how many ranks to spawn when no launcher started this process (default 2); under a
    launcher it must be absent or equal to the job's size. ``threads`` sets torch's intra-op
    threads per rank (spawned ranks default to an even share of this machine's cores, since
    oversubscribed ranks measure the scheduler rather than the code). ``settings`` go to
    ``ringtrain.init``.
    """
    here = placement()
    if here.launcher != "single":
        if np is not None and np != here.size:
            raise ConfigError(
                f"-np {np} was given, but this process is rank {here.rank} of a job of "
                f"{here.size} started by {here.launcher}.\n"
                "HINT: leave -np out when a launcher starts the ranks; it decides their number."
            )
        return _run_in_place(fn, params, threads, dict(settings), timeout_s)
    n = 2 if np is None else np
    if n < 1:
        raise ConfigError(f"-np must be >= 1, got {n}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // n)
    _say_if_oversubscribed(n, threads)
    return _spawn(fn, params, n, threads, dict(settings), timeout_s)


def _say_if_oversubscribed(n: int, threads: int) -> None:
    """One line when the spawned ranks' threads outnumber this process's cores: they then take
    turns on the cores, and absolute times measure the scheduler as much as the code."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if n * threads > (cores or 1):
        print(
            f"bench: {n} ranks x {threads} threads on {cores} cores: they share cores, so read "
            "the ratios within this run, not the absolute times.",
            file=sys.stderr,
        )


def _run_in_place(
    fn: Callable[[P], R],
    params: P,
    threads: int | None,
    settings: dict[str, Any],
    timeout_s: float | None = None,
) -> R | None:
    """``fn`` on this rank. ``timeout_s``: under a launcher, the time this rank may take before
    it gives up (spawned ranks are timed by the process that spawned them)."""
    import torch

    import ringtrain

    watchdog = _give_up_after(timeout_s) if timeout_s is not None else None
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        ringtrain.init(**settings)
        try:
            result = fn(params)
            rank = ringtrain.rank()
        finally:
            ringtrain.shutdown()
    finally:
        if watchdog is not None:
            watchdog.cancel()
    return result if rank == 0 else None


def _give_up_after(timeout_s: float) -> threading.Timer:
    """Ends this process with one line and exit code 1 after ``timeout_s``: a rank may be
    waiting in a collective for a peer, where no exception reaches it; its launcher then ends
    the job, naming it."""

    def give_up() -> None:
        print(
            f"bench: no result within --timeout {timeout_s:g} s: giving up.\n"
            "HINT: raise --timeout, or lower --max-steps (converge) or the sizes measured.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    return timer


def _child(
    rank: int,
    size: int,
    port: int,
    threads: int,
    settings: dict[str, Any],
    fn: Callable[[Any], Any],
    params: Any,
    conn: Connection,
    cpus: tuple[int, ...] | None = None,
) -> None:
    import ctypes

    if cpus:  # as `ringtrain run` binds ranks by default: timings then match a real job's
        os.sched_setaffinity(0, cpus)
    # Die with the parent (the fork server, which exits with this benchmark's process), even
    # if it is SIGKILLed.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    environ.update(rank_env.variables(rank, size, "127.0.0.1", port))
    environ.set_var(Threads.OMP_NUM_THREADS, str(threads))
    try:
        result = _run_in_place(fn, params, threads, settings)
        conn.send(("ok", result))
    except BaseException as e:  # report everything, the parent decides
        # A collective that ended because a peer failed or left is a consequence: the parent
        # shows the rank that failed first on its own, whatever its number.
        status = "after" if isinstance(e, CollectiveAbortedError) else "error"
        conn.send((status, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _spawn(
    fn: Callable[[P], R],
    params: P,
    n: int,
    threads: int,
    settings: dict[str, Any],
    timeout_s: float,
) -> R | None:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    # A fork server that has imported torch once forks every rank after that in milliseconds;
    # a plain spawn re-imports torch in every rank of every run (seconds each). The server is a
    # clean single-threaded process, so forking it is safe where forking this one might not be.
    # torch._dynamo too: a rank's first torch optimizer imports it (seconds of CPU). The server
    # is the process's one: ringtrain.testing.spawn's worlds fork from it too when a benchmark
    # started it, so this list holds theirs (spawn.PRELOAD) as well.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch._dynamo",
            "ringtrain",
            "ringtrain.torch",
            "ringtrain.bench.allreduce",
            "ringtrain.bench.cpu",
            "ringtrain.bench.secure",
            "ringtrain.bench.train",
        ]
    )
    conns: list[Connection] = []
    procs: list[Any] = []
    try:
        for r in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_child,
                args=(r, n, store.port, threads, settings, fn, params, child, _cores_for(r, n)),
                name=f"ringtrain-bench-rank{r}",
                daemon=True,
            )
            p.start()
            child.close()
            conns.append(parent)
            procs.append(p)
        results, errors, after = _collect(conns, procs, timeout_s)
    finally:
        _reap(procs, conns)
        del store
    if errors:
        raise LaunchError(_failure(errors, after))
    return results[0]


def _failure(errors: dict[int, str], after: set[int]) -> str:
    """The failed ranks, the first that failed on its own in full (the lowest rank if each
    only saw a peer fail), the others' first lines."""
    first = min((r for r in errors if r not in after), default=min(errors))
    others = "".join(
        f"rank {r}: {errors[r].splitlines()[0]}\n" for r in sorted(errors) if r != first
    )
    return (
        f"the benchmark failed on rank(s) {sorted(errors)}; rank {first} said:\n"
        f"{errors[first]}\n"
        + (f"and then:\n{others}" if others else "")
        + "HINT: the other ranks' errors are usually consequences of the first one."
    )


def _cores_for(rank: int, size: int) -> tuple[int, ...] | None:
    """The cores ``ringtrain run --bind-to auto`` would give local rank ``rank`` of ``size``:
    an even share each when every rank can have at least one core, else no binding."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // size
    return tuple(cpus[rank * per : (rank + 1) * per]) if per >= 1 else None


def _collect(
    conns: list[Connection], procs: list[Any], timeout_s: float
) -> tuple[dict[int, Any], dict[int, str], set[int]]:
    """Each rank's result or error, and the ranks whose error followed a peer's failure."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    after: set[int] = set()
    waiting = dict(enumerate(conns))
    deadline = time.monotonic() + timeout_s
    while waiting:
        left = deadline - time.monotonic()
        # Once one rank failed the others can only wait for it: give them a moment, not the
        # whole timeout, to report their own view of the failure.
        if errors:
            left = min(left, 10.0)
        ready = wait(list(waiting.values()), timeout=max(0.0, left))
        if not ready:
            for r in waiting:
                errors.setdefault(r, f"no answer within {timeout_s:g} s (still running)")
            break
        for r, conn in list(waiting.items()):
            if conn not in ready:
                continue
            try:
                status, value = conn.recv()
            except EOFError:
                procs[r].join(1)
                status, value = "error", f"rank {r} died (exit code {procs[r].exitcode})"
            del waiting[r]
            if status == "ok":
                results[r] = value
            else:
                errors[r] = value
                if status == "after":
                    after.add(r)
    return results, errors, after


def _reap(procs: list[Any], conns: list[Connection]) -> None:
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2)
    for c in conns:
        c.close()
    sys.stdout.flush()
