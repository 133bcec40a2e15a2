"""What ``ringtrain run`` checks before any rank starts: each bad setting is one error (and a
HINT), not a job that starts and fails later on every rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain import cli, compression
from ringtrain.config import COMPRESSIONS, Config
from ringtrain.errors import SecurityError
from ringtrain.launch import command
from ringtrain.security import keys

PY = sys.executable


def _marker_job(tmp_path: Path) -> list[str]:
    """A rank command that leaves a file behind if it ever runs."""
    return ["--", PY, "-c", f"open({str(tmp_path / 'started')!r}, 'w').close()"]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ringtrain run: error:")]


def test_the_launchers_compression_names_are_the_registered_ones() -> None:
    assert set(COMPRESSIONS) == set(compression.base.names())


def test_unknown_compression_is_refused_before_ranks_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["run", "-np", "1", "--compression", "zstd", *_marker_job(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    [line] = _error_lines(err)
    assert "'zstd'" in line and "fp16" in line
    assert "HINT:" in err and "Traceback" not in err
    assert not (tmp_path / "started").exists()


def test_a_key_file_others_can_read_is_refused_before_ranks_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = Path(keys.write_key_file(tmp_path / "job.key", keys.generate_job_key()))
    os.chmod(key, 0o644)
    argv = ["run", "-np", "1", "--secure", "--key-file", str(key), *_marker_job(tmp_path)]
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    [line] = _error_lines(err)
    assert "has mode 644" in line
    assert f"chmod 600 {key}" in err and "Traceback" not in err
    assert not (tmp_path / "started").exists()
    os.chmod(key, 0o600)  # the same file, private: the check passes
    command.check_settings(Config(secure=True, key_file=str(key)))


def test_a_key_file_without_a_key_is_refused(tmp_path: Path) -> None:
    key = tmp_path / "job.key"
    key.write_text("not a key\n")
    key.chmod(0o600)
    with pytest.raises(SecurityError, match="does not hold a job key"):
        command.check_settings(Config(secure=True, key_file=str(key)))


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ((), "host localhost has no interface named 'nosuch0'; it has: "),
        # secure mode: the agent looks the named interface up instead of enumerating (enclaves)
        (("--secure",), "no interface of that name has an IPv4 address on localhost"),
    ],
)
def test_a_missing_interface_is_named_before_ranks_start(
    tmp_path: Path, flags: tuple[str, ...], says: str
) -> None:
    """On one host: the launcher's own agent reports the interfaces; no Gloo traceback."""
    argv = [PY, "-m", "ringtrain", "run", "-np", "2", *flags, "--network-interface", "nosuch0"]
    proc = subprocess.run(
        [*argv, *_marker_job(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert says in proc.stderr
    assert "Traceback" not in proc.stderr and "enforce fail" not in proc.stderr
    assert not (tmp_path / "started").exists()
