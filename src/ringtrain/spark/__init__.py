"""Run a function on Spark tasks as the ranks of one job: ``horovod.spark.run``'s meaning.

``run(fn, args, kwargs, num_proc)`` starts ``num_proc`` Spark tasks in one barrier stage (Spark
schedules them all at once, or fails the stage when the cluster has fewer slots), runs
``fn(*args, **kwargs)`` in a fresh Python process in each, as rank ``i`` of ``num_proc``, and
returns their results ordered by rank. ``fn`` calls ``hvd.init()`` as under any launcher: task 0
serves the rendezvous store, its address travels through Spark's barrier ``allGather``, and every
rank finds it in the variables ``ringtrain run`` would set. ``fn``, its arguments and its result
travel with Spark's cloudpickle, as Horovod's do.

Spark's own :class:`pyspark.ml.torch.distributor.TorchDistributor` runs a ringtrain *script*
unchanged (it starts torchrun in each task; see docs/engines.md). Needs ``pip install
'ringtrain[spark]'`` (pyspark) and a Java runtime for Spark itself.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

from ringtrain import environ
from ringtrain.errors import ConfigError, LaunchEnvironmentError
from ringtrain.launch import rank_env
from ringtrain.spark import start_watch
from ringtrain.spark.relay import Address, Line, Relay, Sender

# The timeout of task 0's store (it serves; the ranks' own waits are RINGTRAIN_TIMEOUT_S).
STORE_TIMEOUT_S = 600.0


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int | None = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks as ranks; their results by rank.

    Horovod's signature. ``num_proc`` defaults to ``spark.default.parallelism``. ``env``:
    variables added to each rank's environment (``RINGTRAIN_*`` settings among them).
    ``stdout``/``stderr``: the ranks' output is written there as they print it, each line
    prefixed ``[rank]`` (and the time its task read it, with ``prefix_output_with_timestamp``);
    without them it stays in the executors' logs. ``verbose`` 2 logs at INFO; ``nics``: the
    network interfaces the ranks use; ``executable``: the ranks' Python (default
    ``sys.executable``). ``start_timeout``: seconds for every task to be running (else
    HOROVOD_SPARK_START_TIMEOUT, else 600), after which the stage is cancelled and
    :class:`~ringtrain.errors.StartTimeoutError` raised (:mod:`ringtrain.spark.start_watch`).
    ``use_gloo`` is accepted (ringtrain always runs over torch.distributed); ``use_mpi`` and
    ``extra_mpi_args`` are refused with the reason. Needs an active SparkSession (or
    SparkContext). A rank that raises fails the stage, and this call, with its traceback.
    """
    _refuse(use_mpi, extra_mpi_args)
    timeout = start_watch.timeout(start_timeout)
    try:
        from pyspark import SparkContext
        from pyspark.cloudpickle import dumps
    except ImportError as e:
        raise ConfigError(
            f"ringtrain.spark needs pyspark ({e}).\nHINT: pip install 'ringtrain[spark]'."
        ) from e
    sc = SparkContext._active_spark_context
    if sc is None:
        raise LaunchEnvironmentError(
            "ringtrain.spark.run found no active SparkContext.\nHINT: start one first, e.g. "
            "SparkSession.builder.master(...).getOrCreate(), and call run() in that program."
        )
    size = sc.defaultParallelism if num_proc is None else num_proc
    if not isinstance(size, int) or size < 1:
        raise ConfigError(f"num_proc must be a positive number of ranks, got {num_proc!r}")
    payload = dumps((fn, tuple(args), dict(kwargs or {})))
    extra = dict(env or {})
    if verbose is not None and verbose >= 2:
        extra.setdefault(environ.setting_var("log_level"), "INFO")
    if nics:
        extra.setdefault(environ.setting_var("network_interface"), ",".join(sorted(nics)))
    relay = _relay(sc, stdout, stderr, prefix_output_with_timestamp)
    how = _How(
        executable or sys.executable,
        capture=relay is not None,
        relay=relay.address if relay is not None else None,
    )

    def task(_: Iterable[int]) -> Iterator[tuple[int, tuple[bytes, list[Line]]]]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        yield ctx.partitionId(), _run_rank(ctx, size, payload, extra, how)

    rdd = sc.parallelize(range(size), size).barrier().mapPartitions(task)
    try:
        by_rank = _collect(sc, rdd, size, timeout)
    finally:
        if relay is not None:
            relay.close()
    if relay is not None:  # lines of tasks that could not reach the driver, once they ended
        for r in range(size):
            relay.write_kept(r, by_rank[r][1])
    return [pickle.loads(by_rank[r][0]) for r in range(size)]


def _collect(sc: Any, rdd: Any, size: int, timeout: start_watch.Timeout) -> dict[int, Any]:
    """The barrier stage's results by rank; its tasks must all run within ``timeout``."""
    watch = start_watch.StartWatch(sc, size, timeout)
    try:
        with watch:
            return dict(rdd.collect())
    except Exception:
        late = watch.error()
        if late is None:
            raise
        raise late from None  # Spark's own words say only that the stage was cancelled


def run_elastic(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    verbose: int | None = 1,
    nics: Iterable[str] | None = None,
    prefix_output_with_timestamp: bool = False,
) -> list[Any]:
    """``horovod.spark.run_elastic``'s signature, refused with the reason: a call written for
    Horovod fails here at once and says what to use, instead of an AttributeError."""
    raise ConfigError(
        "ringtrain.spark.run_elastic is not supported: ringtrain runs a job on Spark as one "
        "barrier stage, whose tasks start together and fail together, so a lost task cannot "
        "leave the world and a new one cannot join it.\nHINT: ringtrain.spark.run runs a fixed "
        "world (resume a failed run from a checkpoint); for a world that shrinks and grows use "
        "`ringtrain run --min-np/--max-np` (with --host-discovery-script) or "
        "ringtrain.ray.ElasticRayExecutor (docs/elastic.md)."
    )


def _relay(
    sc: Any, stdout: IO[str] | None, stderr: IO[str] | None, timestamps: bool
) -> Relay | None:
    """Where the tasks send their ranks' lines, if any stream is given: the driver's Spark
    address, which the executors reach already."""
    if stdout is None and stderr is None:
        return None
    advertise = sc.getConf().get("spark.driver.host") or "localhost"
    bind = sc.getConf().get("spark.driver.bindAddress") or advertise
    return Relay(bind, advertise, stdout, stderr, timestamps)


def _refuse(use_mpi: bool | None, extra_mpi_args: str | None) -> None:
    """Horovod's arguments that have no meaning here: a clear error instead of a quiet no-op."""
    if use_mpi or extra_mpi_args:
        raise ConfigError(
            "ringtrain.spark.run: use_mpi/extra_mpi_args are not supported: the ranks talk over "
            "torch.distributed (Gloo on CPU), never MPI.\nHINT: drop them (use_gloo=True is "
            "accepted)."
        )


@dataclass(frozen=True)
class _How:
    """How a task runs its rank: the interpreter, whether its output comes back, and where the
    driver's relay listens (None: the lines go back with the task's result)."""

    executable: str
    capture: bool
    relay: Address | None = None


def _run_rank(
    ctx: Any, size: int, payload: bytes, extra: Mapping[str, str], how: _How
) -> tuple[bytes, list[Line]]:
    """In Spark task ``ctx.partitionId()``: serve or find the store, run the rank's process."""
    rank = ctx.partitionId()
    host = ctx.getTaskInfos()[0].address.rsplit(":", 1)[0]  # task 0's executor, as Spark sees it
    store = None
    if rank == 0:  # serves while the ranks run; they connect as clients
        # Only here: the other tasks would import torch (a second of CPU) for nothing.
        import torch.distributed as dist

        store = dist.TCPStore(
            host,
            0,
            world_size=None,
            is_master=True,
            timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
            wait_for_workers=False,
            use_libuv=True,
        )
    port = ctx.allGather(str(store.port) if store is not None else "")[0]
    env = {
        k: v for k, v in environ.current().items() if not k.startswith(("RINGTRAIN_", "HOROVOD_"))
    }
    env.update(rank_env.variables(rank, size, host, port))
    env.update(extra)
    # Connected before the rank starts: a driver that cannot be reached costs the connect's
    # timeout here, not a rank blocked on a full pipe meanwhile.
    sink = Sender(how.relay if how.capture else None, rank)
    errors: list[str] = []  # stderr's lines: the executor's log and a failure's message quote it
    with tempfile.TemporaryDirectory(prefix="ringtrain-spark-") as tmp:
        result = os.path.join(tmp, "result")
        code = "import sys, ringtrain.spark as s; s._child(sys.argv[1])"
        proc = subprocess.Popen(
            [how.executable, "-c", code, result],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if how.capture else None,
            stderr=subprocess.PIPE,
            env=env,
        )
        readers = [
            threading.Thread(target=_read_lines, args=(fd, pipe, sink, errors), daemon=True)
            for fd, pipe in ((1, proc.stdout), (2, proc.stderr))
            if pipe is not None
        ]
        for t in readers:
            t.start()
        assert proc.stdin is not None
        # A rank that ends before reading its function (a Python without ringtrain) breaks
        # the pipe: its own error, on stderr, is what the task reports.
        with contextlib.suppress(BrokenPipeError), proc.stdin:
            proc.stdin.write(payload)
        returncode = proc.wait()
        for t in readers:
            t.join()
        sink.close()
        text = "".join(line + "\n" for line in errors)
        sys.stderr.write(text)  # the executor's log keeps the rank's errors
        if returncode != 0:  # Spark aborts the barrier stage: the other ranks stop too
            raise RuntimeError(f"ringtrain.spark.run: rank {rank} failed:\n{text[-4000:]}")
        ctx.barrier()  # task 0's store outlives every rank
        del store
        with open(result, "rb") as f:
            return f.read(), sink.kept if how.capture else []


def _read_lines(fd: int, pipe: IO[bytes], sink: Sender, errors: list[str]) -> None:
    """A rank's ``fd`` line by line, each to ``sink`` with the time it was read, and stderr's
    also into ``errors`` (list.append is atomic)."""
    for raw in pipe:
        line = raw.decode(errors="replace").rstrip("\n")
        sink.line(fd, time.time(), line)
        if fd == 2:
            errors.append(line)


def _child(result_path: str) -> None:
    """A rank's process: ``fn`` from stdin, its pickled result to ``result_path``."""
    import contextlib
    import ctypes
    import signal

    with contextlib.suppress(OSError):  # die with the Spark task that started it, if killed
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    from pyspark.cloudpickle import dumps

    fn, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    out = fn(*args, **kwargs)
    import ringtrain

    ringtrain.shutdown()  # if fn did not: peers wait for each other here, as at exit
    with open(result_path, "wb") as f:
        f.write(dumps(out))
