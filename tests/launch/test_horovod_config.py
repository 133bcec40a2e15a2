"""horovodrun's ``--config-file`` under ``ringtrain run``: each key sets what the HOROVOD_*
variable horovodrun makes of it sets here, a flag given wins, keys without effect are named once
with why, and a bad file stops the launch with the file and the key named. (A real job reads a
file in tests/launch/test_horovodrun.py's ``test_real_job_with_horovodrun_flags_and_horovod_variables``.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.errors import ConfigError
from ringtrain.launch import command

# Every key of Horovod's own example file (its test data), with its values.
HOROVODS_EXAMPLE = """
controller: gloo

params:
  fusion_threshold_mb: 32
  cycle_time_ms: 10
  cache_capacity: 2048
  hierarchical_allreduce: true
  hierarchical_allgather: true

autotune:
  enabled: true
  log_file: 'horovod_autotune_log.txt'
  warmup_samples: 5
  steps_per_sample: 20
  bayes_opt_max_samples: 50
  gaussian_process_noise: 0.9

timeline:
  filename: 'horovod_timeline.json'
  mark_cycles: true

stall_check:
  enabled: true
  warning_time_seconds: 120
  shutdown_time_seconds: 240

library_options:
  mpi_threads_disable: true
  num_nccl_streams: 2
  ccl_bgt_affinity: 1
  gloo_timeout_seconds: 60

logging:
  level: INFO
  hide_timestamp: true
"""


def _options(tmp_path: Path, text: str, *flags: str):
    (tmp_path / "hvd.yaml").write_text(text)
    argv = ["run", "-np", "2", "--config-file", str(tmp_path / "hvd.yaml"), *flags, "true"]
    return command.checked_options(cli.build_parser(argv).parse_args(argv))


def test_horovods_example_sets_what_its_variables_set_here(tmp_path: Path, capsys) -> None:
    options = _options(tmp_path, HOROVODS_EXAMPLE)
    assert options.settings == {
        "fusion_threshold_bytes": 32 * 1024 * 1024,
        "cycle_time_ms": 10.0,
        "cache_capacity": 2048,
        "hierarchical": "on",
        "timeline_filename": "horovod_timeline.json",
        "stall_warning_s": 120.0,
        "stall_shutdown_s": 240.0,
        "timeout_s": 60.0,
        "log_level": "INFO",
    }
    notes = capsys.readouterr().err.splitlines()
    where = f"ringtrain run: --config-file {tmp_path / 'hvd.yaml'}: "
    assert notes == [
        where + "controller: --gloo is not needed: ranks always talk over torch.distributed "
        "(Gloo on CPU)",
        where + "params.hierarchical_allgather: no effect here (allgather is always flat)",
        where + "autotune.enabled, autotune.log_file, autotune.warmup_samples, "
        "autotune.steps_per_sample, autotune.bayes_opt_max_samples, "
        "autotune.gaussian_process_noise: no effect here (no autotuner; compression='auto' "
        "measures and picks)",
        where + "timeline.mark_cycles: no effect here (the timeline has no cycle marks)",
        where + "library_options.mpi_threads_disable: no effect here (no MPI inside ringtrain)",
        where + "library_options.num_nccl_streams: no effect here (NCCL knob; engine_streams "
        "sets concurrent buckets)",
        where + "library_options.ccl_bgt_affinity: no effect here (no oneCCL)",
        where + "logging.hide_timestamp: no effect here (Python logging formats ringtrain's log)",
    ]


def test_a_flag_given_wins_over_the_files_key(tmp_path: Path) -> None:
    text = "params:\n  cycle_time_ms: 10\n  fusion_threshold_mb: 8\nstall_check:\n  enabled: true\n"
    text += "  warning_time_seconds: 120\n"
    options = _options(tmp_path, text, "--cycle-time-ms", "5", "--no-stall-check")
    assert options.settings == {
        "cycle_time_ms": 5.0,
        "fusion_threshold_bytes": 8 * 1024 * 1024,
        "stall_warning_s": 0.0,
    }


@pytest.mark.parametrize("order", ["enabled first", "enabled last"])
def test_a_disabled_stall_check_beats_its_warning_time_in_any_order(
    tmp_path: Path, order: str
) -> None:
    keys = ["  enabled: false", "  warning_time_seconds: 120"]
    keys = keys if order == "enabled first" else keys[::-1]
    options = _options(tmp_path, "stall_check:\n" + "\n".join(keys) + "\n")
    assert options.settings == {"stall_warning_s": 0.0}  # as HOROVOD_STALL_CHECK_DISABLE=1


def test_switches_off_and_an_autotuner_that_is_off_say_nothing(tmp_path: Path, capsys) -> None:
    text = "params:\n  hierarchical_allreduce: false\n  hierarchical_allgather: false\n"
    text += "autotune:\n  enabled: false\n  warmup_samples: 5\ntimeline:\n  mark_cycles: false\n"
    assert _options(tmp_path, text).settings == {"hierarchical": "off"}
    assert capsys.readouterr().err == ""


def test_a_file_given_as_a_pipe_is_read_once_for_its_settings_and_its_notes(capsys) -> None:
    """``--config-file <(make-config)``: the shell's pipe reads empty a second time, so the
    launcher reads the file once (it read it twice and said none of its notes)."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"controller: gloo\nparams:\n  cycle_time_ms: 10\n")
        os.close(write_end)
        path = f"/dev/fd/{read_end}"
        argv = ["run", "-np", "2", "--config-file", path, "true"]
        options = command.checked_options(cli.build_parser(argv).parse_args(argv))
    finally:
        os.close(read_end)
    assert options.settings == {"cycle_time_ms": 10.0}
    assert capsys.readouterr().err.splitlines() == [
        f"ringtrain run: --config-file {path}: controller: --gloo is not needed: ranks always "
        "talk over torch.distributed (Gloo on CPU)"
    ]


def test_an_empty_file_sets_nothing(tmp_path: Path) -> None:
    assert _options(tmp_path, "# nothing yet\n").settings == {}


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("params:\n  fusion_treshold_mb: 32\n", "params.fusion_treshold_mb is not a key horovodrun "
         "reads.\nHINT: the keys of params are fusion_threshold_mb, cycle_time_ms,"),
        ("parms:\n  cycle_time_ms: 5\n", "'parms' is not a section horovodrun reads.\nHINT: its "
         "sections are controller, params, autotune,"),
        ("params:\n  hierarchical_allreduce: 'no'\n", "params.hierarchical_allreduce must be true "
         "or false, got 'no'"),
        ("params:\n  fusion_threshold_mb: -1\n", "params.fusion_threshold_mb: -1 is not valid: "
         "horovodrun passes it on as HOROVOD_FUSION_THRESHOLD=-1048576, which must be an integer "
         "of bytes, >= 0"),
        ("params:\n  cycle_time_ms: fast\n", "params.cycle_time_ms: 'fast' is not valid: "
         "horovodrun passes it on as HOROVOD_CYCLE_TIME=fast, which must be a number of "
         "milliseconds, > 0"),
        ("logging:\n  level: LOUD\n", "logging.level: 'LOUD' is not valid: horovodrun passes it "
         "on as HOROVOD_LOG_LEVEL=LOUD, which must be one of TRACE"),
        ("params: 32\n", "params must hold keys (key: value), got 32"),
        ("- params\n", "the file must hold sections (params:, timeline:, ...), got list"),
        ("params: [\n", "is not valid YAML"),
        ("controller: nccl\n", "controller: 'nccl' is not a controller horovodrun knows"),
    ],
)  # fmt: skip
def test_a_bad_file_names_itself_and_the_key(tmp_path: Path, text: str, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        _options(tmp_path, text)
    assert f"--config-file {tmp_path / 'hvd.yaml'}" in str(e.value) and said in str(e.value)


def test_a_missing_file_stops_the_launch_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "-np", "1", "--config-file", "nope.yaml", "true"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--config-file nope.yaml: cannot read it: No such file or directory" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_without_pyyaml_the_launch_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyYAML is an extra (ringtrain[k8s]): a plain install that is given a file says so."""
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(ConfigError) as e:
        _options(tmp_path, "params:\n  fusion_threshold_mb: 32\n")
    said = str(e.value)
    assert f"--config-file {tmp_path / 'hvd.yaml'}: reading YAML needs PyYAML" in said, said
    assert "HINT: pip install PyYAML (or pip install 'ringtrain[k8s]')" in said, said
