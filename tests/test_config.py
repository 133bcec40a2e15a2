"""The one configuration object and its environment twins."""

from __future__ import annotations

import math
import os
import pwd
import re
import shutil
import tempfile
from dataclasses import fields
from pathlib import Path

import pytest

from ringtrain.config import (
    NUMBERS,
    Config,
    check_launch_settings,
    check_path,
    env_var,
    settings_from,
    to_env,
)
from ringtrain.environ import horovod_unused
from ringtrain.errors import ConfigError


def test_defaults_env_then_overrides() -> None:
    c = Config.from_env(
        {"RINGTRAIN_CYCLE_TIME_MS": "5", "RINGTRAIN_SECURE": "yes"}, cycle_time_ms=2.0
    )
    assert c.cycle_time_ms == 2.0 and c.secure is True
    assert Config.from_env({}).fusion_threshold_bytes == 64 * 1024 * 1024
    assert Config.from_env({}).cache_capacity == 8192


def test_unknown_variable_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="RINGTRAIN_FUSION_TRESHOLD"):
        Config.from_env({"RINGTRAIN_FUSION_TRESHOLD": "1"})


def test_bad_values() -> None:
    with pytest.raises(ConfigError, match="not a valid bool"):
        Config.from_env({"RINGTRAIN_SECURE": "maybe"})
    with pytest.raises(ConfigError, match="cycle_time_ms must be > 0"):
        Config.from_env({}, cycle_time_ms=0)
    with pytest.raises(ConfigError, match="unknown ringtrain setting"):
        Config.from_env({}, no_such_knob=1)


def test_launcher_placement_variables_are_not_settings() -> None:
    Config.from_env({"RINGTRAIN_RANK": "0", "RINGTRAIN_RENDEZVOUS_PORT": "1"})


def test_round_trip_through_env() -> None:
    env = to_env(secure=True, cycle_time_ms=3.5, timeline_filename="t.json")
    assert env == {
        "RINGTRAIN_SECURE": "1",
        "RINGTRAIN_CYCLE_TIME_MS": "3.5",
        "RINGTRAIN_TIMELINE_FILENAME": "t.json",
    }
    c = Config.from_env(env)
    assert (c.secure, c.cycle_time_ms, c.timeline_filename) == (True, 3.5, "t.json")
    assert env_var("stall_warning_s") == "RINGTRAIN_STALL_WARNING_S"


# ---- Horovod's variables ------------------------------------------------------------------------


def test_horovod_variables_map_onto_config_in_horovods_units() -> None:
    c = Config.from_env(
        {
            "HOROVOD_FUSION_THRESHOLD": "33554432",  # bytes
            "HOROVOD_CYCLE_TIME": "3.5",  # milliseconds
            "HOROVOD_TIMELINE": "/tmp/tl.json",
            "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
            "HOROVOD_STALL_CHECK_TIME_SECONDS": "20",
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90",
            "HOROVOD_GLOO_IFACE": "eth1",
            "HOROVOD_LOG_LEVEL": "trace",
            "HOROVOD_CACHE_CAPACITY": "0",
        }
    )
    assert c.fusion_threshold_bytes == 32 * 1024 * 1024
    assert c.cycle_time_ms == 3.5
    assert c.timeline_filename == "/tmp/tl.json"
    assert c.hierarchical == "on"
    assert (c.stall_warning_s, c.stall_shutdown_s) == (20, 90)
    assert c.network_interface == "eth1"
    assert c.log_level == "DEBUG"  # Horovod's TRACE is below DEBUG; Python has no TRACE
    assert c.cache_capacity == 0
    assert Config.from_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}).hierarchical == "off"
    assert Config.from_env({"HOROVOD_LOG_LEVEL": "FATAL"}).log_level == "CRITICAL"
    # DYNAMIC: no file at init, hvd.start_timeline() starts one later (as in Horovod).
    assert Config.from_env({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline_filename == ""
    # The stall check switched off outright beats its warning time.
    off = {"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}
    assert Config.from_env(off).stall_warning_s == 0
    assert Config.from_env({"HOROVOD_STALL_CHECK_DISABLE": "0"}).stall_warning_s == 60


def test_ringtrain_variable_wins_over_horovods_and_arguments_over_both() -> None:
    env = {
        "HOROVOD_FUSION_THRESHOLD": "1024",
        "RINGTRAIN_FUSION_THRESHOLD_BYTES": "2048",
        "HOROVOD_CYCLE_TIME": "7",
    }
    c = Config.from_env(env)
    assert (c.fusion_threshold_bytes, c.cycle_time_ms) == (2048, 7.0)
    assert Config.from_env(env, fusion_threshold_bytes=4096).fusion_threshold_bytes == 4096


@pytest.mark.parametrize(
    ("var", "raw", "expected"),
    [
        ("HOROVOD_FUSION_THRESHOLD", "64MB", "an integer of bytes"),
        ("HOROVOD_FUSION_THRESHOLD", "-1", "an integer of bytes, >= 0"),
        ("HOROVOD_CYCLE_TIME", "0", "a number of milliseconds, > 0"),
        ("HOROVOD_HIERARCHICAL_ALLREDUCE", "maybe", "0 or 1"),
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1m", "an integer of seconds"),
        ("HOROVOD_LOG_LEVEL", "LOUD", "TRACE, DEBUG, INFO, WARNING, ERROR, FATAL"),
        ("HOROVOD_CACHE_CAPACITY", "lots", "an integer of requests"),
    ],
)
def test_bad_horovod_value_names_the_variable(var: str, raw: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        Config.from_env({var: raw})
    assert f"{var}={raw!r} is not valid" in str(e.value) and expected in str(e.value)
    assert "RINGTRAIN_" in str(e.value)  # the hint names ringtrain's own twin


def test_horovod_variables_without_meaning_are_listed_with_why() -> None:
    env = {
        "HOROVOD_MPI_THREADS_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "HOROVOD_AUTOTUNE": "1",
        "HOROVOD_SOMETHING_NEW": "x",
        # Mapped or placement: not listed.
        "HOROVOD_CYCLE_TIME": "2",
        "HOROVOD_RANK": "0",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
        "PATH": "/bin",
    }
    listed = dict(horovod_unused(env))
    assert set(listed) == {
        "HOROVOD_MPI_THREADS_DISABLE",
        "NCCL_IB_DISABLE",
        "HOROVOD_AUTOTUNE",
        "HOROVOD_SOMETHING_NEW",
    }
    assert "no MPI" in listed["HOROVOD_MPI_THREADS_DISABLE"]
    assert "no effect on Gloo" in listed["NCCL_IB_DISABLE"]
    assert listed["HOROVOD_SOMETHING_NEW"] == "not known to ringtrain"
    Config.from_env(env)  # accepted: none of them is an error


def test_log_level_is_checked_and_normalized() -> None:
    assert Config(log_level="info").log_level == "INFO"
    with pytest.raises(ConfigError, match="log_level must be one of"):
        Config(log_level="chatty")


# ---- every value checked: numbers, types, paths -------------------------------------------------

NUMERIC = [f.name for f in fields(Config) if f.type in ("int", "float")]


def test_every_numeric_field_has_one_rule() -> None:
    assert set(NUMBERS) == set(NUMERIC)


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1])
def test_nan_inf_and_negative_numbers_are_refused_naming_the_field(name: str, bad: float) -> None:
    with pytest.raises(ConfigError) as e:
        Config(**{name: bad})
    first, *rest = str(e.value).splitlines()
    assert first.startswith(f"{name} must be ") and first.endswith(f"got {bad!r}")
    assert [line for line in rest if line.startswith("HINT: ")] == rest and len(rest) == 1
    # Its variable twin: the same rule (or, for a whole number, the parser), the variable first.
    with pytest.raises(ConfigError, match="^" + re.escape(f"{env_var(name)}='{bad}'")):
        Config.from_env({env_var(name): str(bad)})


def test_horovods_variables_meet_the_same_rules() -> None:
    with pytest.raises(ConfigError, match=r"^HOROVOD_CYCLE_TIME='nan': cycle_time_ms must be > 0"):
        Config.from_env({"HOROVOD_CYCLE_TIME": "nan"})
    with pytest.raises(ConfigError, match="RINGTRAIN_CACHE_CAPACITY='1e400' is not a valid int"):
        Config.from_env({"RINGTRAIN_CACHE_CAPACITY": "1e400"})


def test_types_are_checked_and_numbers_converted() -> None:
    with pytest.raises(ConfigError, match=r"timeout_s must be > 0 .*got '30s'"):
        Config(timeout_s="30s")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"fusion_threshold_bytes must be >= 0 .*whole.*got 1.5"):
        Config(fusion_threshold_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="overlap must be true or false, got 'yes'"):
        Config(overlap="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="compression must be text"):
        Config(compression=2.5)  # type: ignore[arg-type]
    c = Config(timeout_s=30, fusion_threshold_bytes=2.0**20, sync_every=8, secure=1)  # type: ignore[arg-type]
    assert (c.timeout_s, c.fusion_threshold_bytes, c.sync_every, c.secure) == (
        30.0,
        2**20,
        "8",
        True,
    )
    assert isinstance(c.timeout_s, float) and isinstance(c.fusion_threshold_bytes, int)


def test_settings_from_a_file_take_text_as_the_variables_do() -> None:
    got = settings_from({"timeout_s": "30", "overlap": "yes", "checkpoint_every": 100})
    assert got == {"timeout_s": 30.0, "overlap": True, "checkpoint_every": "100"}
    with pytest.raises(ConfigError, match=r"^settings: timeout_s='30s' is not a valid float\nHINT"):
        settings_from({"timeout_s": "30s"})
    with pytest.raises(ConfigError, match=r"^--set timeout_s=nan: timeout_s must be > 0"):
        settings_from({"timeout_s": "nan"}, "--set")
    with pytest.raises(ConfigError, match=r"^settings: compresion: unknown ringtrain setting"):
        settings_from({"compresion": "fp16"})


def _refusal_as_a_user_not_root(path: str) -> tuple[str, str]:
    """check_path's message for ``path``, and the user it checked for. Root writes anywhere, so
    as root the check runs in a forked child that has become ``nobody`` (uid 65534), its $USER
    still root's, as after ``su``."""
    if os.getuid() != 0:
        with pytest.raises(ConfigError) as e:
            check_path("--x", path)
        return str(e.value), _name(os.getuid())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.environ["USER"] = "root"
            try:
                check_path("--x", path)
                os.write(write, b"no error")
            except ConfigError as e:
                os.write(write, str(e).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    os.waitpid(pid, 0)
    return message, _name(65534)


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def test_paths_in_a_directory_this_user_cannot_write_are_refused() -> None:
    # Under /tmp, not tmp_path: as root the check runs as nobody, who must reach the directory.
    base = Path(tempfile.mkdtemp())
    locked = base / "locked"
    try:
        base.chmod(0o755)
        locked.mkdir(mode=0o555)
        message, user = _refusal_as_a_user_not_root(str(locked / "new" / "t.json"))
        check_path("--x", str(locked / "t.json"), writable=False)  # only read: no refusal
    finally:
        shutil.rmtree(base)
    assert message == (
        f"--x: this user ({user}) cannot write in {locked}.\n"
        "HINT: give a path in a directory you can write to."
    )


def test_a_launchers_compression_must_be_ringtrains() -> None:
    check_launch_settings(Config(compression="fp16"), {"compression": "--compression"})
    check_launch_settings(Config(compression="mine"), {})  # set by the script: its own
    with pytest.raises(ConfigError, match=r"^settings: compression 'zstd' is not one of"):
        check_launch_settings(Config(compression="zstd"), {"compression": "settings: compression"})


def test_paths_whose_parent_is_a_file_are_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    check_path("--x", str(tmp_path / "new" / "deeper"), directory=True)  # creatable
    check_path("--x", str(tmp_path / "new.json"))
    with pytest.raises(
        ConfigError, match=re.escape(f"--x 'v': {tmp_path / 'f'} is a file, not a directory")
    ):
        check_path("--x 'v'", str(tmp_path / "f" / "sub" / "t.json"))
    with pytest.raises(
        ConfigError, match=re.escape(f"--x: {tmp_path / 'f'} is a file, not a directory")
    ):
        check_path("--x", str(tmp_path / "f"), directory=True)
    with pytest.raises(ConfigError, match=re.escape(f"--x: {tmp_path} is a directory, not a file")):
        check_path("--x", str(tmp_path))
