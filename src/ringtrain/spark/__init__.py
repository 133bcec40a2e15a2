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

import datetime
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ringtrain import environ
from ringtrain.errors import ConfigError, LaunchEnvironmentError
from ringtrain.launch import rank_env

# How long task 0's store waits for the others (they start together: a barrier stage).
STORE_TIMEOUT_S = 600.0


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` Spark tasks as ranks; their results by rank.

    ``num_proc`` defaults to ``spark.default.parallelism``, as in Horovod. ``env``: variables
    added to each rank's environment (``RINGTRAIN_*`` settings among them). Needs an active
    SparkSession (or SparkContext). A rank that raises fails the Spark stage, and with it this
    call, with that rank's traceback.
    """
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

    def task(_: Iterable[int]) -> Iterator[tuple[int, bytes]]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        yield ctx.partitionId(), _run_rank(ctx, size, payload, extra)

    rdd = sc.parallelize(range(size), size).barrier().mapPartitions(task)
    by_rank = dict(rdd.collect())
    return [pickle.loads(by_rank[r]) for r in range(size)]


def _run_rank(ctx: Any, size: int, payload: bytes, extra: Mapping[str, str]) -> bytes:
    """In Spark task ``ctx.partitionId()``: serve or find the store, run the rank's process."""
    import torch.distributed as dist

    rank = ctx.partitionId()
    host = ctx.getTaskInfos()[0].address.rsplit(":", 1)[0]  # task 0's executor, as Spark sees it
    store = None
    if rank == 0:  # serves while the ranks run; they connect as clients
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
    with tempfile.TemporaryDirectory(prefix="ringtrain-spark-") as tmp:
        result, errors = os.path.join(tmp, "result"), os.path.join(tmp, "stderr")
        code = "import sys, ringtrain.spark as s; s._child(sys.argv[1])"
        with open(errors, "wb") as err:
            proc = subprocess.run(
                [sys.executable, "-c", code, result], input=payload, env=env, stderr=err
            )
        with open(errors, "rb") as err:
            text = err.read().decode(errors="replace")
        sys.stderr.write(text)  # the executor's log keeps the rank's output
        if proc.returncode != 0:  # Spark aborts the barrier stage: the other ranks stop too
            raise RuntimeError(f"ringtrain.spark.run: rank {rank} failed:\n{text[-4000:]}")
        ctx.barrier()  # task 0's store outlives every rank
        del store
        with open(result, "rb") as f:
            return f.read()


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
