"""horovodrun's command lines and HOROVOD_* environment under ``ringtrain run``.

The flags are checked against their ringtrain counterparts in the pure planner (same options,
same settings); one real job shows them reaching the ranks, with horovodrun's per-rank output
files and the Horovod variables mapped onto every rank's Config.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.errors import ConfigError, LaunchError
from ringtrain.host.network import Interface, plan_network
from ringtrain.launch import rank_env
from ringtrain.launch.command import options_from_args
from ringtrain.launch.horovodrun import not_needed
from ringtrain.launch.hosts import Host


def _parse(*argv: str):
    args = cli.build_parser(["run", *argv]).parse_args(["run", *argv])
    return args, options_from_args(args)


def _same(horovod: list[str], ringtrain: list[str]) -> None:
    _, a = _parse(*horovod, "python", "train.py")
    _, b = _parse(*ringtrain, "python", "train.py")
    assert a == b


@pytest.mark.parametrize(
    ("horovod", "ringtrain"),
    [
        (["--network-interfaces", "eth0"], ["--network-interface", "eth0"]),
        (["--hierarchical-allreduce"], ["--hierarchical", "on"]),
        (["--no-hierarchical-allreduce"], ["--hierarchical", "off"]),
        (["--fusion-threshold-mb", "32"], ["--fusion-threshold-mb", "32.0"]),
        (["--cycle-time-ms", "5"], ["--cycle-time-ms", "5.0"]),
        (["--timeline-filename", "t.json"], ["--timeline-filename", "t.json"]),
        (["--log-level", "INFO"], ["--log-level", "info"]),
        (["--stall-check-warning-time-seconds", "30"], ["--stall-warning-time", "30"]),
        (["--stall-check-shutdown-time-seconds", "90"], ["--stall-shutdown-time", "90"]),
        (["--no-stall-check"], ["--stall-warning-time", "0"]),
        (["-i", "/k"], ["--ssh-identity-file", "/k"]),
        (["--gloo"], []),
        (["--mpi"], []),
        (["--disable-cache"], []),
        (["-prefix-timestamp"], ["--prefix-output-with-timestamp"]),
    ],
)
def test_horovodrun_flag_plans_as_its_ringtrain_counterpart(
    horovod: list[str], ringtrain: list[str]
) -> None:
    _same(["-np", "2", *horovod], ["-np", "2", *ringtrain])


def test_horovodrun_flags_reach_config_settings() -> None:
    _, o = _parse(
        "-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "5", "--hierarchical-allreduce",
        "--network-interfaces", "eth0", "--timeline-filename", "t.json", "--log-level", "TRACE",
        "--cache-capacity", "0", "--output-filename", "logs", "python", "train.py",
    )  # fmt: skip
    assert o.settings == {
        "fusion_threshold_bytes": 32 * 1024 * 1024,  # horovodrun: MB * 1024 * 1024
        "cycle_time_ms": 5.0,
        "hierarchical": "on",
        "network_interface": "eth0",
        "timeline_filename": "t.json",
        "log_level": "DEBUG",  # Horovod's TRACE: Python's nearest level
        "cache_capacity": 0,
    }
    assert o.output_dir == "logs"


def test_network_interfaces_limit_the_choice_per_host() -> None:
    # horovodrun --network-interfaces eth7,eth0: the NICs the job may use; each host takes one.
    _, o = _parse("-np", "2", "--network-interfaces", "eth7, eth0", "true")
    assert o.interface_candidates == ("eth7", "eth0") and "network_interface" not in o.settings
    view = {
        "h0": [Interface("eth0", "198.18.0.10", 24), Interface("ib0", "198.19.0.10", 24)],
        "h1": [Interface("eth7", "198.18.0.11", 24), Interface("ib0", "198.19.0.11", 24)],
    }
    hellos = {h: [i.to_dict() for i in ifaces] for h, ifaces in view.items()}
    launcher = [Interface("eth0", "198.18.0.1", 24)]
    _, env = plan_network(hellos, local=launcher, candidates=o.interface_candidates)
    assert env["h0"]["GLOO_SOCKET_IFNAME"] == "eth0" and env["h1"]["GLOO_SOCKET_IFNAME"] == "eth7"
    # Only ib0 allowed: the choice goes there, although eth* would do too.
    _, env = plan_network(hellos, local=[Interface("ib0", "198.19.0.1", 24)], candidates=["ib0"])
    assert {e["GLOO_SOCKET_IFNAME"] for e in env.values()} == {"ib0"}
    with pytest.raises(LaunchError, match="host h1 has none of them"):
        plan_network(hellos, local=launcher, candidates=["eth0"])
    with pytest.raises(ConfigError, match="not both"):
        _parse("-np", "2", "--network-interfaces", "a,b", "--network-interface", "a", "true")
    with pytest.raises(ConfigError, match="empty entry"):
        _parse("-np", "2", "--network-interfaces", "a,,b", "true")


def test_horovodrun_placement_flags() -> None:
    # horovodrun -np 4 -H a:2,b:2 -p 2222 --start-timeout 30 --verbose python train.py
    _, o = _parse(
        "-np", "4", "-H", "a:2,b:2", "-p", "2222", "--start-timeout", "30", "--verbose",
        "python", "train.py",
    )  # fmt: skip
    assert o.hosts == (Host("a", 2), Host("b", 2)) and o.np == 4
    assert (o.ssh.port, o.start_timeout_s, o.verbose) == (2222, 30.0, True)
    assert o.command == ("python", "train.py")  # no "--" needed, as with horovodrun


def test_horovodrun_hostfile(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")  # horovodrun's format
    _, o = _parse("-np", "4", "--hostfile", str(hostfile), "python", "train.py")
    assert o.hosts == (Host("a", 2), Host("b", 2))


def test_flags_not_needed_say_so_in_one_line_each() -> None:
    args, _ = _parse("-np", "1", "--gloo", "--mpi", "--disable-cache", "true")
    lines = not_needed(args)
    assert len(lines) == 3 and all("is not needed" in line for line in lines)
    assert not_needed(_parse("-np", "1", "true")[0]) == []


def test_horovod_variables_are_forwarded_to_remote_hosts() -> None:
    env = {"HOROVOD_CYCLE_TIME": "2", "SECRET": "s"}
    assert rank_env.forwarded(env, []) == {"HOROVOD_CYCLE_TIME": "2"}


def _run(*argv: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


SCRIPT = """
import logging
import torch
import ringtrain.torch as hvd
from ringtrain.runtime import state

hvd.init()
c = state.current().config
for _ in range(3):
    hvd.allreduce(torch.ones(2), name="same")
controller = state.global_process_set.communicator.service("controller")
print("config", c.fusion_threshold_bytes, c.cycle_time_ms, c.hierarchical, c.stall_warning_s,
      c.cache_capacity, logging.getLogger("ringtrain").level == logging.DEBUG, c.timeout_s)
print("cached", len(controller._requests.cache))
print("to stderr", hvd.rank(), file=__import__("sys").stderr)
hvd.shutdown()
"""


# horovodrun's YAML file: the flags given win over its keys, its keys over the environment.
CONFIG_FILE = """
params:
  fusion_threshold_mb: 2  # beats HOROVOD_FUSION_THRESHOLD
  cycle_time_ms: 7  # --cycle-time-ms 4 beats it
  hierarchical_allreduce: true  # --no-hierarchical-allreduce beats it
timeline:
  mark_cycles: true  # no effect here: one line says so
library_options:
  gloo_timeout_seconds: 60  # --timeout 200 beats it
"""


@pytest.mark.parametrize("np", [2, 4])
def test_real_job_with_horovodrun_flags_and_horovod_variables(tmp_path: Path, np: int) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {
        "HOROVOD_FUSION_THRESHOLD": "1048576",
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "40",
        "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_LOG_LEVEL": "TRACE",
        "RINGTRAIN_STALL_WARNING_S": "45",  # ringtrain's own variable wins
        "RINGTRAIN_CYCLE_TIME_MS": "3",  # ...but not over the launcher's flag (--cycle-time-ms)
        "HOROVOD_MPI_THREADS_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
    }
    (tmp_path / "hvd.yaml").write_text(CONFIG_FILE)
    proc = _run(
        "-np", str(np), "--gloo", "-v", "--output-filename", "logs", "--no-hierarchical-allreduce",
        "--cycle-time-ms", "4", "--timeout", "200", "-x", "RINGTRAIN_TIMEOUT_S=100",
        "--config-file", "hvd.yaml", sys.executable, "train.py", env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Flag (launcher) > --config-file > RINGTRAIN_* (environment or -x) > HOROVOD_*; TRACE reads
    # as DEBUG.
    for rank in range(np):
        assert f"[{rank}] config 2097152 4.0 off 45.0 0 True 200.0" in proc.stdout
        assert f"[{rank}] cached 0" in proc.stdout  # HOROVOD_CACHE_CAPACITY=0: no cache
    assert proc.stderr.count("timeline.mark_cycles: no effect here") == 1
    # One line for --gloo, and the variables without meaning listed once.
    assert proc.stderr.count("--gloo is not needed") == 1
    unused = [line for line in proc.stderr.splitlines() if "accepted without effect" in line]
    assert len(unused) == 1
    assert "HOROVOD_MPI_THREADS_DISABLE" in unused[0] and "NCCL_IB_DISABLE" in unused[0]
    # horovodrun's --output-filename layout, unprefixed lines, console output kept.
    ranks = [f"rank.{r}" for r in range(np)]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ranks
    for rank in range(np):
        out = (tmp_path / "logs" / f"rank.{rank}" / "stdout").read_text()
        assert out.startswith("config 2097152") and "cached 0" in out
        err = (tmp_path / "logs" / f"rank.{rank}" / "stderr").read_text()
        assert f"to stderr {rank}" in err


STAMPED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3}) (.*)$")
TIMED = """\
import os, sys, time
print("first", time.time(), flush=True)  # before the launcher has finished starting the job
time.sleep(1.0)
print("second", time.time(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.exit(3 if os.environ["HOROVOD_RANK"] == "1" else 0)
"""


def _stamped(line: str) -> tuple[float, str]:
    """A stamped line's time (seconds since the epoch) and the rest of it."""
    found = STAMPED.match(line)
    assert found, f"no timestamp at the start of {line!r}"
    when = time.mktime(time.strptime(found.group(1), "%Y-%m-%d %H:%M:%S"))
    return when + int(found.group(2)) / 1000, found.group(3)


def test_prefix_output_with_timestamp_stamps_each_line_when_it_arrives(tmp_path: Path) -> None:
    (tmp_path / "timed.py").write_text(TIMED)
    began = time.time()
    proc = _run(
        "-np", "2", "--prefix-output-with-timestamp", "--output-filename", "logs",
        sys.executable, "timed.py", env={}, cwd=tmp_path,
    )  # fmt: skip
    ended = time.time()
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 4, proc.stdout
    for line in lines:
        when, rest = _stamped(line)
        printed = float(rest.split()[-1])  # the rank's own clock, the same machine's
        assert began - 1 <= when <= ended + 1, line
        # The time the line reached the launcher, not when the launcher got round to showing
        # it: the first lines arrive while it still starts the job (its store's process
        # imports torch), and were stamped over a second late when that was the stamp.
        assert printed - 0.002 <= when < printed + 0.7, proc.stdout
    for rank in range(2):
        files = {
            fd: (tmp_path / "logs" / f"rank.{rank}" / fd).read_text().splitlines()
            for fd in ("stdout", "stderr")
        }
        assert [_stamped(line)[1].split()[0] for line in files["stdout"]] == ["first", "second"]
        assert "to stderr" in [_stamped(line)[1] for line in files["stderr"]]
    # ringtrain run's own lines carry the same stamps as the ranks'.
    report = [line for line in proc.stderr.splitlines() if "ringtrain run: job failed" in line]
    assert report and _stamped(report[0])[1].startswith("ringtrain run: job failed: rank 1")


def test_bad_horovod_value_stops_the_launch_once(tmp_path: Path) -> None:
    proc = _run(
        "-np", "2", sys.executable, "-c", "print('ran')",
        env={"HOROVOD_FUSION_THRESHOLD": "64MB"}, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and "ran" not in proc.stdout
    assert proc.stderr.count("HOROVOD_FUSION_THRESHOLD='64MB' is not valid") == 1


def test_output_filename_pads_ranks_to_one_width(tmp_path: Path) -> None:
    from ringtrain.launch.supervisor import Supervisor

    _, o = _parse("-np", "11", "--output-filename", str(tmp_path / "d"), "true")
    sup = Supervisor(o)
    sup.output.file(3, 2).write("x\n")
    sup.output.file(10, 1).write("y\n")
    sup.output.close()
    assert (tmp_path / "d" / "rank.03" / "stderr").read_text() == "x\n"
    assert (tmp_path / "d" / "rank.10" / "stdout").read_text() == "y\n"


def test_output_filename_opens_every_rank_s_files_afresh(tmp_path: Path) -> None:
    # horovodrun (gloo_run.py) opens DIR/rank.N/stdout and stderr with "w" as each rank starts:
    # a rank that prints nothing has empty files, not none, nor an earlier job's lines.
    stale = tmp_path / "d" / "rank.1" / "stdout"
    stale.parent.mkdir(parents=True)
    stale.write_text("an earlier job's line\n")
    quiet_rank_1 = "import os; os.environ['HOROVOD_RANK'] == '0' and print('hi')"
    proc = _run(
        "-np", "2", "--output-filename", str(tmp_path / "d"), sys.executable, "-c", quiet_rank_1,
        env={}, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    files = {
        p.relative_to(tmp_path / "d").as_posix(): p.read_text()
        for p in (tmp_path / "d").rglob("*")
        if p.is_file()
    }
    assert files == {
        "rank.0/stdout": "hi\n", "rank.0/stderr": "", "rank.1/stdout": "", "rank.1/stderr": "",
    }  # fmt: skip


def test_bad_flag_value_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    proc = _run("-np", "1", "--log-level", "LOUD", "true", env={}, cwd=tmp_path)
    assert proc.returncode == 2 and "log_level must be one of" in proc.stderr


@pytest.mark.parametrize("flag", ["--autotune", "--hierarchical-allgather", "--mpi-args"])
def test_horovodrun_flags_without_a_counterpart_are_refused(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.build_parser(["run"]).parse_args(["run", "-np", "1", flag, "x", "true"])
    assert (
        e.value.code == 2 and f"horovodrun's {flag} is not supported: " in capsys.readouterr().err
    )


def test_horovod_gloo_iface_picks_the_interface_on_remote_hosts() -> None:
    from types import SimpleNamespace

    from ringtrain.launch.supervisor import Supervisor

    _, o = _parse("-np", "2", "-H", "h0:1,h1:1", "true")
    sup = Supervisor(o, env={"HOROVOD_GLOO_IFACE": "ib0"})
    ifaces = {"h0": "198.19.0.10", "h1": "198.19.0.11"}  # test-cluster space
    sup.links = [
        SimpleNamespace(
            host=Host(h, 1),
            hello={
                "interfaces": [
                    Interface("eth0", f"198.18.0.1{i}", 24).to_dict(),
                    Interface("ib0", addr, 24).to_dict(),
                ]
            },
        )
        for i, (h, addr) in enumerate(ifaces.items())
    ]
    _, env = sup._network()
    assert {h: e["GLOO_SOCKET_IFNAME"] for h, e in env.items()} == {"h0": "ib0", "h1": "ib0"}


def test_verbose_sets_the_ranks_log_level_unless_the_job_set_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/launch.md: ``--verbose`` makes the ranks log at INFO, unless RINGTRAIN_LOG_LEVEL or
    HOROVOD_LOG_LEVEL (or --log-level) says otherwise."""
    assert _parse("-np", "1", "--verbose", "true")[1].settings["log_level"] == "INFO"
    assert "log_level" not in _parse("-np", "1", "true")[1].settings
    monkeypatch.setenv("HOROVOD_LOG_LEVEL", "warning")
    assert "log_level" not in _parse("-np", "1", "--verbose", "true")[1].settings
    monkeypatch.delenv("HOROVOD_LOG_LEVEL")
    monkeypatch.setenv("RINGTRAIN_LOG_LEVEL", "DEBUG")
    assert "log_level" not in _parse("-np", "1", "--verbose", "true")[1].settings
