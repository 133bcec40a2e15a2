"""How long a Spark run's tasks may take to start: ``horovod.spark.run``'s ``start_timeout``.

The ranks run as the tasks of one barrier stage, which Spark starts only once the cluster has a
free slot for every task: on a busy cluster, or one that allocates executors on demand, the
stage waits with nothing to show (Spark fails it by itself only where the whole cluster has
fewer slots than tasks, and by default only after 40 checks 15 s apart). So the driver watches
the stage through Spark's status tracker while it waits, and when not every task is running by
the deadline it cancels the stage, and only it (a job tag of its own), and raises
:class:`~ringtrain.errors.StartTimeoutError` with Horovod's words.

The stage is found by its job group: the caller's, if its thread has one (a notebook's cell
keeps its own, so cancelling the cell still cancels the run), else one made for the run.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, NamedTuple

from ringtrain import environ
from ringtrain.errors import ConfigError, StartTimeoutError

DEFAULT_S = 600.0  # Horovod's default
POLL_S = 0.2
_GROUP = "spark.jobGroup.id"


class Timeout(NamedTuple):
    """How long the tasks may take to start, and where that was set (the error names it)."""

    seconds: float
    source: str  # "start_timeout", the variable's name, or Horovod's default


def timeout(given: float | None) -> Timeout:
    """``start_timeout`` as Horovod reads it: the argument, else HOROVOD_SPARK_START_TIMEOUT,
    else 600 seconds."""
    where = "start_timeout"
    value: Any = given
    if value is None:
        where = environ.HorovodDriver.SPARK_START_TIMEOUT
        value = environ.current().get(where)
    if value is None:
        return Timeout(DEFAULT_S, "the default start_timeout")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:
        raise ConfigError(
            f"ringtrain.spark.run: {where} must be a positive number of seconds, got {value!r}"
        )
    return Timeout(seconds, where)


class StartWatch:
    """``with StartWatch(sc, size, timeout): rdd.collect()``: the stage the block submits is
    cancelled if not all ``size`` of its tasks run within ``timeout``; the block's exception
    is then to be replaced by :meth:`error`'s."""

    def __init__(self, sc: Any, size: int, timeout: Timeout) -> None:
        self._sc = sc
        self._size = size
        self._timeout = timeout
        self._tag = f"ringtrain-spark-{secrets.token_hex(8)}"
        callers = sc.getLocalProperty(_GROUP)
        self._own_group = callers is None
        self._group = self._tag if callers is None else callers
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="spark-start-watch", daemon=True)
        self.running = 0  # the most tasks seen running at once
        self.timed_out = False

    def __enter__(self) -> StartWatch:
        tracker = self._sc.statusTracker()
        self._before = set(tracker.getJobIdsForGroup(self._group))
        if self._own_group:
            self._sc.setLocalProperty(_GROUP, self._group)
        self._sc.addJobTag(self._tag)
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._sc.removeJobTag(self._tag)
        if self._own_group:
            self._sc.setLocalProperty(_GROUP, None)

    def error(self) -> StartTimeoutError | None:
        """The timeout's error if the watch cancelled the stage, else None (ask where the
        block's own exception is caught: Spark's "cancelled" says less)."""
        if not self.timed_out:
            return None
        return StartTimeoutError(
            "Timed out waiting for Spark tasks to start: "
            f"{self.running} of {self._size} tasks were running after "
            f"{self._timeout.seconds:g} s ({self._timeout.source}), so the run's stage was "
            "cancelled.\nHINT: each rank is one Spark task, and the tasks start together once "
            "the cluster has a free slot for each: free slots (other jobs hold them), run fewer "
            "ranks (num_proc), or give executors allocated on demand more time (start_timeout, or "
            f"{environ.HorovodDriver.SPARK_START_TIMEOUT})."
        )

    def _watch(self) -> None:
        deadline = self._start + self._timeout.seconds
        while not self._done.wait(POLL_S):
            try:
                self.running = max(self.running, self._tasks_running())
                if self.running >= self._size:
                    return  # started: the ranks' own timeouts apply from here
                if time.monotonic() >= deadline:
                    self._sc.cancelJobsWithTag(self._tag)
                    self.timed_out = True
                    return
            except Exception:  # the context stopped under the run: collect() says so itself
                return

    def _tasks_running(self) -> int:
        tracker = self._sc.statusTracker()
        most = 0
        for job_id in set(tracker.getJobIdsForGroup(self._group)) - self._before:
            job = tracker.getJobInfo(job_id)
            for stage_id in job.stageIds if job is not None else ():
                stage = tracker.getStageInfo(stage_id)
                if stage is not None:
                    most = max(most, stage.numActiveTasks + stage.numCompletedTasks)
        return most
