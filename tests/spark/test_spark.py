"""ringtrain on Spark (issue 27): ``ringtrain.spark.run`` (``horovod.spark.run``'s meaning) and
Spark's own TorchDistributor running a ringtrain script unchanged, on a real Spark
``local-cluster[2,1,1024]`` (2 executor JVMs of 1 core each). One Spark session serves the module:
Spark starts slowly.

Needs pyspark (``ringtrain[spark]``, installed by scripts/setup) and Java (scripts/setup installs
Debian's headless JDK when ``java`` is missing); the module skips, saying which, without them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# One worker runs the module, so its Spark session (the module fixture, ~20 s) starts once.
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("spark")]
pyspark = pytest.importorskip(
    "pyspark", reason="pyspark is not installed: pip install 'ringtrain[spark]'"
)
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip(
        "Spark needs Java: run scripts/setup as root to install it", allow_module_level=True
    )

from pyspark.sql import SparkSession  # noqa: E402

import ringtrain.spark  # noqa: E402
from ringtrain.errors import StartTimeoutError  # noqa: E402

JOB = Path(__file__).with_name("ringtrain_job.py")
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# The ranks' processes cannot import this test module: its functions travel by value (those of
# a user's __main__ script do so anyway).
pyspark.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .appName("ringtrain-tests")
        .config("spark.driver.memory", "1g")
        .config("spark.ui.enabled", "false")
        # The 3 JVMs (driver, 2 executors) live a few minutes: C1 alone and the serial GC
        # halve the CPU they spend starting on the 2-core CI machine (C2 and parallel GC
        # threads pay off only in long jobs). Spark's behaviour under test is the same.
        .config("spark.driver.extraJavaOptions", JVM_OPTIONS)
        .config("spark.executor.extraJavaOptions", JVM_OPTIONS)
        .config("spark.executorEnv.OMP_NUM_THREADS", "1")
        # A barrier stage larger than the cluster fails after this many checks (default 40, 15 s
        # apart: 10 minutes, for clusters that grow).
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures", "1")
        .config("spark.scheduler.barrier.maxConcurrentTasksCheck.interval", "1s")
        .getOrCreate()
    )
    try:
        _wait_for_executors(session.sparkContext, 2)
        yield session
    finally:
        session.stop()
        _end_gateway()


def _wait_for_executors(sc: Any, count: int, timeout: float = 120.0) -> None:
    """Return once ``count`` executors have registered. ``getOrCreate()`` returns as the
    local-cluster's executor JVMs start, and a barrier stage run before both have registered
    fails Spark's slot check at once (maxFailures 1 above): BarrierJobSlotsNumberCheckFailed."""
    deadline = time.monotonic() + timeout
    while True:
        executors = sc._jsc.sc().getExecutorMemoryStatus().size() - 1  # the driver counts too
        if executors >= count:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{executors} of {count} Spark executors registered in {timeout} s"
            )
        time.sleep(0.2)


def _end_gateway() -> None:
    """End the gateway JVM that pyspark started for this process. ``SparkSession.stop()`` leaves
    it running, kept for a next session, and the worker that ran this module would hold it idle
    until the run ends: a distributed test leaves no process behind."""
    from pyspark import SparkContext

    gateway, SparkContext._gateway, SparkContext._jvm = SparkContext._gateway, None, None
    if gateway is None:
        return
    proc = getattr(gateway, "proc", None)  # None where the JVM was not ours to start
    gateway.shutdown()
    if proc is None:
        return
    proc.stdin.close()  # the JVM ends on EOF from its parent (pyspark's java_gateway.py)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise AssertionError("the Spark gateway JVM did not end when its input closed") from None


def _train(steps: int, lr: float = 0.1, seen: str = "") -> dict[str, Any]:
    import torch

    import ringtrain.torch as hvd
    from ringtrain.runtime import state as runtime

    torch.set_num_threads(1)
    hvd.init()
    live = None
    if seen and hvd.rank() == 0:  # until the driver has this line: only a stream shows it now
        print("live 0", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(seen) and time.monotonic() < deadline:
            time.sleep(0.05)
        live = os.path.exists(seen)
    torch.manual_seed(100 + hvd.rank())
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters()
    )
    data = torch.Generator().manual_seed(hvd.rank())
    for _ in range(steps):
        x = torch.randn(8, 4, generator=data)
        opt.zero_grad()
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    every = hvd.allgather(weights.unsqueeze(0))
    print(f"trained {hvd.rank()}", flush=True)
    print(f"warned {hvd.rank()}", file=sys.stderr, flush=True)
    config = runtime.current().config
    out = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "identical": all(torch.equal(every[0], every[r]) for r in range(hvd.size())),
        "sum": hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item(),
        "cycle_time_ms": config.cycle_time_ms,
        "log_level": config.log_level,
        "network_interface": config.network_interface,
        "live": live,
    }
    hvd.shutdown()
    return out


def _fail(rank_to_fail: int) -> None:
    # Raises before importing torch: what is shown is how a rank's exception reaches the
    # driver, and each rank's import of torch would cost seconds.
    raise ValueError(f"boom in every rank (rank {rank_to_fail} asked)")


class _Watched(io.StringIO):
    """The driver's stdout: notes on disk when rank 0's "live 0" line has been written to it."""

    def __init__(self, seen: Path) -> None:
        super().__init__()
        self.seen = seen

    def write(self, s: str) -> int:
        n = super().write(s)
        if s.endswith("[0] live 0\n"):
            self.seen.write_text("written")
        return n


def test_run_returns_the_results_by_rank(spark: Any, tmp_path: Path) -> None:
    # num_proc left out: spark.default.parallelism, the 2 cores of local-cluster[2,1,...].
    env = {"RINGTRAIN_CYCLE_TIME_MS": "7"}  # a setting, as docs/engines.md says
    out, err = _Watched(tmp_path / "seen"), io.StringIO()
    began = time.time()
    # The arguments of Horovod's own Spark examples.
    res = ringtrain.spark.run(
        _train, args=(3,), kwargs={"lr": 0.05, "seen": str(out.seen)}, env=env, stdout=out,
        stderr=err, verbose=2, prefix_output_with_timestamp=True, use_gloo=True, nics=["lo"],
        executable=sys.executable,
    )  # fmt: skip
    assert [r["rank"] for r in res] == [0, 1]
    # Rank 0 went on only once the driver had written its first line: streamed as it came.
    assert res[0]["live"] is True, out.getvalue()
    for r in res:
        assert r["size"] == 2 and r["identical"] and r["sum"] == 3.0
        assert r["cycle_time_ms"] == 7.0
        assert r["log_level"] == "INFO" and r["network_interface"] == "lo"
    # The ranks' output, each line stamped when its task read it.
    stamped = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.\d{3} \[(\d)\] (.*)"
    lines = [re.fullmatch(stamped, line) for line in out.getvalue().splitlines()]
    got = [m.group(2, 3) for m in lines if m]
    assert all(lines) and got[0] == ("0", "live 0"), out.getvalue()
    assert sorted(got) == [("0", "live 0"), ("0", "trained 0"), ("1", "trained 1")], got
    for m in lines:
        assert m is not None
        when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
        assert began - 1 <= when <= time.time() + 1
    assert "[0] warned 0" in err.getvalue() and "[1] warned 1" in err.getvalue()


def test_a_failing_rank_fails_the_run_with_its_traceback(spark: Any) -> None:
    with pytest.raises(Exception, match="boom in every rank"):
        ringtrain.spark.run(_fail, args=(1,), num_proc=2)


def test_more_ranks_than_slots_is_spark_s_error(spark: Any) -> None:
    with pytest.raises(Exception, match=r"(?i)barrier"):
        ringtrain.spark.run(_train, args=(1,), num_proc=3)


def _stage_tasks(sc: Any, group: str) -> int:
    """Tasks running or done in the stages of ``group``'s jobs."""
    tracker = sc.statusTracker()
    jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(group)]
    stages = [tracker.getStageInfo(s) for job in jobs if job for s in job.stageIds]
    return sum(s.numActiveTasks + s.numCompletedTasks for s in stages if s)


def test_tasks_that_cannot_start_in_time_are_cancelled_with_horovods_error(spark: Any) -> None:
    """Another job holds both slots: the run's barrier stage waits for free ones (Spark itself
    would wait as long as they stay taken). start_timeout cancels that stage, and only it."""
    sc = spark.sparkContext
    busy = "ringtrain-test-busy"

    def hold_both_slots() -> None:
        sc.setJobGroup(busy, "holds both slots", interruptOnCancel=True)
        with contextlib.suppress(Exception):  # cancelled below
            sc.parallelize(range(2), 2).foreach(lambda _: time.sleep(300))

    holder = threading.Thread(target=hold_both_slots, daemon=True)
    holder.start()
    try:
        deadline = time.monotonic() + 120
        while _stage_tasks(sc, busy) < 2:
            assert time.monotonic() < deadline, "the busy job never took both slots"
            time.sleep(0.2)
        # Called as a notebook's cell calls it, in a job group of its own.
        sc.setJobGroup("caller", "the caller's group")
        began = time.monotonic()
        with pytest.raises(
            StartTimeoutError, match=r"^Timed out waiting for Spark tasks to start: 0 of 2 tasks"
        ) as e:
            ringtrain.spark.run(_train, args=(1,), num_proc=2, start_timeout=3)
        took = time.monotonic() - began
        assert 3 <= took < 60, took
        assert "after 3 s (start_timeout)" in str(e.value)  # where the 3 s were set
        assert "HINT" in str(e.value) and "num_proc" in str(e.value)
        assert _stage_tasks(sc, busy) == 2  # the other job runs on, untouched
        assert sc.getLocalProperty("spark.jobGroup.id") == "caller"  # the caller's, kept
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.cancelJobGroup(busy)
        holder.join(60)
    # Nothing of the cancelled stage is left waiting: a barrier stage gets both slots now.
    assert sc.parallelize(range(2), 2).barrier().mapPartitions(lambda _: [1]).collect() == [1, 1]


def test_torch_distributor_runs_a_ringtrain_script_unchanged(spark: Any, tmp_path: Path) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(str(JOB), str(tmp_path))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert r["size"] == 2 and r["launcher"] == "torchrun"
        assert r["identical"] and r["trained"]
    # TorchDistributor starts one torchrun "node" per Spark task: the launcher's answer is
    # two nodes of one rank each, and ringtrain takes it.
    assert {(r["local_size"], r["cross_size"]) for r in res} == {(1, 2)}
