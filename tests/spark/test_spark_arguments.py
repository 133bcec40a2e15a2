"""``ringtrain.spark.run`` takes Horovod's signature: the arguments that mean nothing here, and
a ``start_timeout`` that is not a time, are refused with the reason before Spark is touched (no
SparkSession needed), never ignored."""

from __future__ import annotations

import shutil
import subprocess
import types

import pytest

import ringtrain.spark
from ringtrain.errors import ConfigError
from ringtrain.spark import start_watch


def _fn() -> None:  # never runs: every call below is refused first
    raise AssertionError("ran")


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"use_mpi": True}, "use_mpi/extra_mpi_args"),
        ({"extra_mpi_args": "-x FOO"}, "use_mpi/extra_mpi_args"),
    ],
)
def test_horovods_arguments_without_a_meaning_are_refused(given: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        ringtrain.spark.run(_fn, num_proc=2, **given)
    msg = str(e.value)
    assert f"ringtrain.spark.run: {named}" in msg and "not supported" in msg and "HINT" in msg


@pytest.mark.parametrize("given", [0, -5, "soon", float("nan")])
def test_a_start_timeout_that_is_not_a_positive_number_is_refused(given: object) -> None:
    with pytest.raises(ConfigError, match=r"start_timeout must be a positive number"):
        ringtrain.spark.run(_fn, num_proc=2, start_timeout=given)  # type: ignore[arg-type]


def test_start_timeout_falls_back_on_horovods_variable_then_on_600_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    var = "HOROVOD_SPARK_START_TIMEOUT"
    monkeypatch.delenv(var, raising=False)
    # Each with where it came from, which the timeout's error names.
    assert start_watch.timeout(None) == (600.0, "the default start_timeout")
    assert start_watch.timeout(7) == (7.0, "start_timeout")
    monkeypatch.setenv(var, "45")
    assert start_watch.timeout(None) == (45.0, var)
    assert start_watch.timeout(7) == (7.0, "start_timeout")  # the argument wins, as in Horovod
    monkeypatch.setenv(var, "ten")
    with pytest.raises(ConfigError, match=rf"{var} must be a positive number"):
        ringtrain.spark.run(_fn, num_proc=2)


def test_the_positions_are_horovods() -> None:
    import inspect

    # horovod.spark.run (v0.28): a call that passes them by position means the same here.
    assert list(inspect.signature(ringtrain.spark.run).parameters) == [
        "fn", "args", "kwargs", "num_proc", "start_timeout", "use_mpi", "use_gloo",
        "extra_mpi_args", "env", "stdout", "stderr", "verbose", "nics",
        "prefix_output_with_timestamp", "executable",
    ]  # fmt: skip


def test_run_elastic_is_refused_with_what_to_use_instead() -> None:
    import inspect

    # horovod.spark.run_elastic (v0.28)'s parameters, so a call written for it reaches the
    # refusal, not a TypeError.
    assert list(inspect.signature(ringtrain.spark.run_elastic).parameters) == [
        "fn", "args", "kwargs", "num_proc", "min_np", "max_np", "start_timeout",
        "elastic_timeout", "reset_limit", "env", "stdout", "stderr", "verbose", "nics",
        "prefix_output_with_timestamp",
    ]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        ringtrain.spark.run_elastic(_fn, num_proc=2, min_np=1, max_np=4)
    msg = str(e.value)
    assert "ringtrain.spark.run_elastic is not supported" in msg and "barrier stage" in msg
    assert "HINT" in msg and "ringtrain.spark.run" in msg and "ElasticRayExecutor" in msg


class _Task:
    """Spark's BarrierTaskContext as rank 1 of 2 sees it (task 0 serves the store)."""

    def partitionId(self) -> int:
        return 1

    def getTaskInfos(self) -> list:
        return [types.SimpleNamespace(address="127.0.0.1:1")]

    def allGather(self, message: str) -> list[str]:
        return ["1", message]

    def barrier(self) -> None:
        raise AssertionError("a failed rank never reaches the barrier")


def test_a_python_without_ringtrain_fails_the_rank_with_its_own_error() -> None:
    # executable= names a Python that cannot import ringtrain: the rank's process ends before
    # it reads its function, which is larger than a pipe holds (a model's bytes, as Horovod's
    # examples pass). The task reports the rank's error, not the broken pipe.
    python = shutil.which("python3", path="/usr/bin")
    if python is None or subprocess.run([python, "-c", "import ringtrain"]).returncode == 0:
        pytest.skip("needs a python3 in /usr/bin without ringtrain")
    how = ringtrain.spark._How(python, capture=True)
    with pytest.raises(RuntimeError, match=r"rank 1 failed:[\s\S]*No module named 'ringtrain'"):
        ringtrain.spark._run_rank(_Task(), 2, b"x" * (4 << 20), {}, how)
