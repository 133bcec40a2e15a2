"""Every flag of horovodrun is accepted with its meaning or refused by name, and the table in
docs/horovod.md is the parser's own (issue 39: a Horovod user's command line never meets a bare
"unrecognized arguments")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.launch import horovodrun

DOC = Path(__file__).parents[2] / "docs" / "horovod.md"
BEGIN, END = "<!-- horovodrun-flags:begin -->", "<!-- horovodrun-flags:end -->"

# Every option string of horovodrun's parser (horovod/runner/launch.py, parse_args, v0.28), in
# its order: what a Horovod user may type.
HOROVODRUN_FLAGS = (
    "-v", "--version", "-np", "--num-proc", "-cb", "--check-build", "--disable-cache",
    "--start-timeout", "--network-interfaces", "--network-interface", "--output-filename",
    "--verbose", "--config-file", "-p", "--ssh-port", "-i", "--ssh-identity-file",
    "--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity", "--hierarchical-allreduce",
    "--no-hierarchical-allreduce", "--hierarchical-allgather", "--no-hierarchical-allgather",
    "--autotune", "--no-autotune", "--autotune-log-file", "--autotune-warmup-samples",
    "--autotune-steps-per-sample", "--autotune-bayes-opt-max-samples",
    "--autotune-gaussian-process-noise", "--min-np", "--min-num-proc", "--max-np",
    "--max-num-proc", "--slots-per-host", "--elastic-timeout", "--reset-limit",
    "--blacklist-cooldown-range", "--timeline-filename", "--timeline-mark-cycles",
    "--no-stall-check", "--stall-check", "--stall-check-warning-time-seconds",
    "--stall-check-shutdown-time-seconds", "--mpi-threads-disable", "--no-mpi-threads-disable",
    "--mpi-args", "--tcp", "--binding-args", "--num-nccl-streams", "--thread-affinity",
    "--gloo-timeout-seconds", "--log-level", "--log-with-timestamp", "--log-without-timestamp",
    "-prefix-timestamp", "--prefix-output-with-timestamp", "--log-hide-timestamp",
    "--no-log-hide-timestamp", "-H", "--hosts", "-hostfile", "--hostfile",
    "--host-discovery-script", "--gloo", "--mpi", "--jsrun",
)  # fmt: skip

# A value for the flags that take one (horovodrun's types), so a line parses as it would there.
VALUES = {
    "-np": "2", "--num-proc": "2", "--start-timeout": "30", "--network-interfaces": "lo",
    "--network-interface": "lo", "--output-filename": "out", "-p": "22", "--ssh-port": "22",
    "-i": "key", "--ssh-identity-file": "key", "--fusion-threshold-mb": "64",
    "--cycle-time-ms": "1", "--cache-capacity": "1024", "--min-np": "1", "--min-num-proc": "1",
    "--max-np": "4", "--max-num-proc": "4", "--slots-per-host": "2", "--elastic-timeout": "600",
    "--reset-limit": "3", "--blacklist-cooldown-range": "10 100", "--timeline-filename": "t.json",
    "--stall-check-warning-time-seconds": "60", "--stall-check-shutdown-time-seconds": "0",
    "--gloo-timeout-seconds": "30", "--log-level": "INFO", "-H": "localhost:2",
    "--hosts": "localhost:2", "-hostfile": "hosts.txt", "--hostfile": "hosts.txt",
    "--config-file": "hvd.yaml",
    "--host-discovery-script": "discover.sh",
}  # fmt: skip


def _parse(flag: str) -> object:
    argv = ["run", flag, *VALUES.get(flag, "").split(), "--", "python", "train.py"]
    return cli.build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("flag", [f for f in HOROVODRUN_FLAGS if f not in horovodrun.REFUSED])
def test_accepted(flag: str) -> None:
    args = _parse(flag)
    assert getattr(args, "command", None) == ["--", "python", "train.py"]


@pytest.mark.parametrize("flag", sorted(horovodrun.REFUSED))
def test_refused_in_one_line_naming_the_flag(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(flag)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2
    assert f"horovodrun's {flag} is not supported: " in err and "unrecognized" not in err


def test_every_refusal_is_a_flag_of_horovodrun() -> None:
    assert set(horovodrun.REFUSED) <= set(HOROVODRUN_FLAGS)


def _rendered() -> str:
    parser = cli.build_parser(["run"])
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    rows = horovodrun.table(run, HOROVODRUN_FLAGS)
    lines = ["| horovodrun | ringtrain run |", "|---|---|"]
    lines += [f"| `{flag}` | {what.replace('|', '/')} |" for flag, what in rows]
    return "\n".join(lines)


def test_the_docs_table_is_the_parsers() -> None:
    text = DOC.read_text()
    found = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    assert found, f"docs/horovod.md lacks the {BEGIN} ... {END} block"
    assert "unknown to ringtrain run" not in _rendered()
    assert found.group(1) == _rendered(), (
        "docs/horovod.md's horovodrun table is out of date; regenerate it with:\n"
        "  python -c 'import tests.launch.test_horovodrun_flags as t; print(t._rendered())'"
    )
