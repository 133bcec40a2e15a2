"""The one configuration object and its environment twins."""

from __future__ import annotations

import pytest

from ringtrain.config import Config, env_var, to_env
from ringtrain.errors import ConfigError


def test_defaults_env_then_overrides() -> None:
    c = Config.from_env(
        {"RINGTRAIN_CYCLE_TIME_MS": "5", "RINGTRAIN_SECURE": "yes"}, cycle_time_ms=2.0
    )
    assert c.cycle_time_ms == 2.0 and c.secure is True
    assert Config.from_env({}).fusion_threshold_bytes == 64 * 1024 * 1024


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
