"""``ringtrain.spark.run`` takes Horovod's signature: the arguments that mean nothing here are
refused with the reason before Spark is touched (no SparkSession needed), never ignored."""

from __future__ import annotations

import pytest

import ringtrain.spark
from ringtrain.errors import ConfigError


def _fn() -> None:  # never runs: every call below is refused first
    raise AssertionError("ran")


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"use_mpi": True}, "use_mpi/extra_mpi_args"),
        ({"extra_mpi_args": "-x FOO"}, "use_mpi/extra_mpi_args"),
        ({"start_timeout": 30}, "start_timeout"),
    ],
)
def test_horovods_arguments_without_a_meaning_are_refused(given: dict, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        ringtrain.spark.run(_fn, num_proc=2, **given)
    msg = str(e.value)
    assert f"ringtrain.spark.run: {named}" in msg and "not supported" in msg and "HINT" in msg


def test_the_positions_are_horovods() -> None:
    import inspect

    # horovod.spark.run (v0.28): a call that passes them by position means the same here.
    assert list(inspect.signature(ringtrain.spark.run).parameters) == [
        "fn", "args", "kwargs", "num_proc", "start_timeout", "use_mpi", "use_gloo",
        "extra_mpi_args", "env", "stdout", "stderr", "verbose", "nics",
        "prefix_output_with_timestamp", "executable",
    ]  # fmt: skip
