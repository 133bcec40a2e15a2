"""What ``ringtrain run`` checks before any rank starts: each bad setting is one error (and a
HINT), not a job that starts and fails later on every rank."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain import cli, compression
from ringtrain.config import COMPRESSIONS, Config
from ringtrain.errors import ConfigError, SecurityError
from ringtrain.launch import command, ssh_flags
from ringtrain.launch.options import SshOptions
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
    """On one host: the launcher's own agent reports the interfaces; no Gloo traceback. Refused
    as the other checks are (exit 2, one line and a whole HINT), not as a failed job."""
    argv = [PY, "-m", "ringtrain", "run", "-np", "2", *flags, "--network-interface", "nosuch0"]
    proc = subprocess.run(
        [*argv, *_marker_job(tmp_path)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    [line] = _error_lines(proc.stderr)
    assert says in line and "--network-interface 'nosuch0'" in line, proc.stderr
    [hint] = [h for h in proc.stderr.splitlines() if h.startswith("HINT: ")]
    assert hint.endswith(".") and "HOST=NAME" in hint, hint  # a whole sentence
    assert "job failed" not in proc.stderr and "lost the connection" not in proc.stderr
    assert "Traceback" not in proc.stderr and "enforce fail" not in proc.stderr
    assert not (tmp_path / "started").exists()


# ---- every value checked before any rank starts (issue 37) --------------------------------------


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """Runs ``ringtrain run`` in-process; returns its one error line, after checking that it
    came with a HINT, without a traceback, and before any rank started."""
    rc = cli.main(["run", "-np", "1", *flags, *_marker_job(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    [line] = _error_lines(err)
    assert "HINT:" in err and "Traceback" not in err
    assert not (tmp_path / "started").exists()
    return line


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--fusion-threshold-mb", "nan"), "--fusion-threshold-mb nan: fusion_threshold_bytes"),
        (("--fusion-threshold-mb", "inf"), "--fusion-threshold-mb inf: fusion_threshold_bytes"),
        (("--timeout", "nan"), "--timeout nan: timeout_s must be > 0"),
        (("--start-timeout", "nan"), "--start-timeout must be > 0 (a finite number of seconds)"),
        (("--ssh-connect-timeout", "-1"), "--ssh-connect-timeout must be >= 1"),
        (("--ssh-keepalive", "0"), "--ssh-keepalive must be >= 1 and <= 3600"),
        (("-p", "70000"), "--ssh-port must be >= 1 and <= 65535"),
        (("--elastic-timeout", "inf", "--min-np", "1"), "--elastic-timeout must be > 0"),
        (("--reset-limit", "-1", "--min-np", "1"), "--reset-limit must be >= 0"),
        (
            ("--blacklist-cooldown-range", "nan", "5", "--min-np", "1"),
            "--blacklist-cooldown-range nan 5: expected 1 <= MIN <= MAX <= 3600",
        ),
    ],
)
@pytest.mark.timeout(60)
def test_the_reported_bad_numbers_are_one_error_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], says: str
) -> None:
    line = _refused(tmp_path, capsys, *flags)
    assert says in line, line


@pytest.mark.parametrize(
    ("flag", "bad"),
    [
        pytest.param(f, bad, id=f"{f.flag}={bad}")
        for f in command.SETTING_FLAGS
        if f.type in (int, float)
        # argparse itself refuses "nan" for an int flag (with the usage line)
        for bad in (["nan", "inf", "-inf", "-1"] if f.type is float else ["-1"])
    ],
)
@pytest.mark.timeout(60)
def test_every_numeric_setting_flag_refuses_nan_inf_and_negatives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: command.SettingFlag, bad: str
) -> None:
    line = _refused(tmp_path, capsys, f"{flag.flag}={bad}")
    assert f"{flag.flag} {bad}: {flag.field} must be " in line


@pytest.mark.parametrize(
    ("flag", "bad", "says"),
    [
        ("--transport", "udp", "transport must be 'auto', 'gloo' or 'tcp', got 'udp'"),
        ("--hierarchical", "maybe", "hierarchical must be 'auto', 'on' or 'off', got 'maybe'"),
        ("--log-level", "loud", "log_level must be one of TRACE, DEBUG, INFO"),
        (
            "--checkpoint-writer",
            "threads",
            "checkpoint_writer must be one of auto, process, thread, got 'threads'",
        ),
    ],
)
@pytest.mark.timeout(60)
def test_a_setting_flag_outside_its_choices_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, bad: str, says: str
) -> None:
    line = _refused(tmp_path, capsys, flag, bad)
    assert f"{flag} {bad}: {says}" in line, line


@pytest.mark.timeout(60)
def test_a_bad_ringtrain_variable_in_the_launchers_environment_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RINGTRAIN_TIMEOUT_S", "nan")
    line = _refused(tmp_path, capsys)
    assert "RINGTRAIN_TIMEOUT_S='nan': timeout_s must be > 0" in line


@pytest.mark.parametrize(
    ("flags", "var", "says"),
    [
        (("--frozen-after", "0"), None, "--frozen-after 0: frozen_after_s must be > 0 (a finite"),
        ((), "0", "RINGTRAIN_FROZEN_AFTER_S='0': frozen_after_s must be > 0 (a finite number"),
        ((), "30s", "RINGTRAIN_FROZEN_AFTER_S='30s' is not a valid float"),
    ],
)
@pytest.mark.timeout(60)
def test_a_bad_frozen_after_is_refused_naming_the_flag_or_variable(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: tuple[str, ...],
    var: str | None,
    says: str,
) -> None:
    """The agents' freeze limit is a job setting like any other: one line, exit 2, a HINT."""
    if var is not None:
        monkeypatch.setenv("RINGTRAIN_FROZEN_AFTER_S", var)
    line = _refused(tmp_path, capsys, *flags)
    assert says in line, line


@pytest.mark.parametrize(
    "flag", ["--timeline-filename", "--checkpoint-dir", "--resume", "--output-filename"]
)
@pytest.mark.timeout(60)
def test_a_path_under_a_regular_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    (tmp_path / "plain").write_text("")
    given = str(tmp_path / "plain" / "sub" / "t.json")
    line = _refused(tmp_path, capsys, flag, given)
    assert f"{flag} {given!r}: {tmp_path / 'plain'} is a file, not a directory" in line


@pytest.mark.timeout(60)
def test_a_timeline_where_nothing_can_be_created_is_refused_as_root_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /proc: root passes os.access there, but no file can be created; each rank died in init()
    # with a long traceback before the check made one.
    line = _refused(tmp_path, capsys, "--timeline-filename", "/proc/t.json")
    assert "--timeline-filename '/proc/t.json': " in line, line
    assert "nothing can be created in /proc" in line or "cannot write in /proc" in line, line


@pytest.mark.timeout(120)
def test_a_timeline_under_a_regular_file_fails_init_clearly_without_the_launcher(
    tmp_path: Path,
) -> None:
    """Ranks started by hand (no launcher to check first): init() names the path."""
    (tmp_path / "plain").write_text("")
    env = {**os.environ, "RINGTRAIN_TIMELINE_FILENAME": str(tmp_path / "plain" / "t.json")}
    script = (
        "import ringtrain.torch as hvd\n"
        "from ringtrain.errors import ConfigError\n"
        "try:\n"
        "    hvd.init()\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
        "    raise SystemExit(3)\n"
    )
    proc = subprocess.run(
        [PY, "-c", script], env=env, capture_output=True, text=True, timeout=110, cwd=tmp_path
    )
    assert proc.returncode == 3, proc.stderr
    assert f"timeline {str(tmp_path / 'plain' / 't.rank0.json')!r}" in proc.stdout
    assert f"{tmp_path / 'plain'} is a file, not a directory" in proc.stdout
    assert "HINT:" in proc.stdout


# ---- input that was ignored in silence, or failed late, refused before anything starts -------


def _cli(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> str:
    """Runs the real ``ringtrain`` command; returns its stderr, after checking that it failed as
    the launcher's own errors do (exit 2, no traceback) and that no rank started."""
    proc = subprocess.run(
        [PY, "-m", "ringtrain", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "started").exists()
    return proc.stderr


def _one_error(err: str) -> str:
    [line] = _error_lines(err)
    assert "\nHINT: " in err, err
    return line


@pytest.mark.parametrize(
    ("flags", "env", "says"),
    [
        (
            ("--checkpoint-every", "10"),
            {},
            "--checkpoint-every 10 is given without --checkpoint-dir",
        ),
        ((), {"RINGTRAIN_CHECKPOINT_EVERY": "300s"}, "RINGTRAIN_CHECKPOINT_EVERY='300s' is given"),
        (("--checkpoint-keep", "2"), {}, "--checkpoint-keep 2 is given without --checkpoint-dir"),
    ],
)
@pytest.mark.timeout(90)
def test_a_checkpoint_setting_without_a_directory_is_refused(
    tmp_path: Path, flags: tuple[str, ...], env: dict[str, str], says: str
) -> None:
    err = _cli(tmp_path, "run", "-np", "1", *flags, *_marker_job(tmp_path), env=env)
    assert says in _one_error(err), err


def test_checkpoint_settings_with_a_directory_or_read_by_a_checkpointer_pass(
    tmp_path: Path,
) -> None:
    for where in ("checkpoint_dir", "resume"):  # --resume gives a directory too
        config = Config(checkpoint_keep=2, **{where: str(tmp_path)})
        command.check_settings(config, {"checkpoint_keep", where})
    # A Checkpointer the script makes with its own directory reads the writer setting
    # (docs/checkpoint.md), so --checkpoint-writer alone does something.
    command.check_settings(Config(checkpoint_writer="thread"), {"checkpoint_writer"})


@pytest.mark.parametrize("every", ["0", "0s", "-5", "nans", "often"])
@pytest.mark.timeout(90)
def test_a_checkpoint_schedule_that_is_no_positive_number_says_so(
    tmp_path: Path, every: str
) -> None:
    flags = ("--checkpoint-dir", str(tmp_path / "ck"), f"--checkpoint-every={every}")
    line = _one_error(_cli(tmp_path, "run", "-np", "1", *flags, *_marker_job(tmp_path)))
    assert f"--checkpoint-every {every}: " in line, line
    assert "expected a positive number of steps or of seconds" in line, line


@pytest.mark.parametrize("kind", ["key", "empty, mode 644"])
@pytest.mark.timeout(90)
def test_a_key_file_without_secure_is_refused_not_left_unused(tmp_path: Path, kind: str) -> None:
    """As ``ringtrain k8s`` does: the job would run unsealed, and the key would do nothing."""
    key = tmp_path / "job.key"
    if kind == "key":
        keys.write_key_file(key, keys.generate_job_key())
    else:
        key.write_bytes(b"")
        key.chmod(0o644)
    err = _cli(tmp_path, "run", "-np", "1", "--key-file", str(key), *_marker_job(tmp_path))
    line = _one_error(err)
    assert f"--key-file {str(key)!r} is given without --secure" in line, err
    assert "HINT: add --secure" in err and "leave --key-file out" in err


def test_a_key_file_with_secure_from_the_environment_passes(tmp_path: Path) -> None:
    key = keys.write_key_file(tmp_path / "job.key", keys.generate_job_key())
    secure = Config.from_env({"RINGTRAIN_SECURE": "1"}, key_file=key)
    command.check_settings(secure, {"key_file"})
    with pytest.raises(ConfigError, match="without --secure"):
        command.check_settings(Config(key_file=key), {"key_file"})
    # RINGTRAIN_KEY_FILE alone keys the ringtrain_sealed DDP backend (docs/security.md)
    command.check_settings(Config.from_env({"RINGTRAIN_KEY_FILE": key}), ())


@pytest.mark.parametrize(
    ("forward", "says"),
    [
        ("RINGTRAIN_TIMOUT=5", "-x: unknown variable RINGTRAIN_TIMOUT='5'"),
        ("RINGTRAIN_TIMEOUT_S=nan", "-x: RINGTRAIN_TIMEOUT_S='nan': timeout_s must be > 0"),
        ("HOROVOD_FUSION_THRESHOLD=abc", "-x: HOROVOD_FUSION_THRESHOLD='abc' is not valid"),
    ],
)
@pytest.mark.timeout(90)
def test_a_bad_variable_given_with_x_is_refused_before_ranks_start(
    tmp_path: Path, forward: str, says: str
) -> None:
    """The ranks' environment is the launcher's plus the -x values: checked as one."""
    err = _cli(tmp_path, "run", "-np", "2", "-x", forward, *_marker_job(tmp_path))
    assert says in _one_error(err), err


@pytest.mark.timeout(60)
def test_x_values_are_checked_with_the_launchers_own(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # -x NAME forwards the launcher's value: refused as that variable, without "-x:"
    monkeypatch.setenv("RINGTRAIN_TIMEOUT_S", "nan")
    line = _refused(tmp_path, capsys, "-x", "RINGTRAIN_TIMEOUT_S")
    assert "error: RINGTRAIN_TIMEOUT_S='nan': timeout_s must be > 0" in line, line
    # the checks between settings see the -x ones too
    monkeypatch.delenv("RINGTRAIN_TIMEOUT_S")
    line = _refused(tmp_path, capsys, "-x", "RINGTRAIN_CHECKPOINT_EVERY=10")
    assert "RINGTRAIN_CHECKPOINT_EVERY='10' is given without --checkpoint-dir" in line, line


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("-H", ""), "-H '' lists no hosts"),
        (("-H", " "), "-H ' ' lists no hosts"),
        (("-H", ",,"), "-H ',,' lists no hosts"),
        (("--hosts=",), "-H '' lists no hosts"),
        (("--hostfile", ""), "--hostfile '' names no file"),
    ],
)
@pytest.mark.timeout(90)
def test_an_empty_host_spec_is_refused_not_read_as_this_host(
    tmp_path: Path, flags: tuple[str, ...], says: str
) -> None:
    err = _cli(tmp_path, "run", "-np", "1", *flags, *_marker_job(tmp_path))
    assert says in _one_error(err), err


@pytest.mark.parametrize("kind", ["missing", "empty", "unreadable"])
@pytest.mark.timeout(90)
def test_a_key_file_ranks_here_cannot_read_is_refused_before_they_start(
    tmp_path: Path, kind: str
) -> None:
    key = tmp_path / "keys" / "job.key"
    if kind != "missing":
        key.parent.mkdir()
        key.write_bytes(b"" if kind == "empty" else keys.encode_key(keys.generate_job_key()))
        key.chmod(0o600 if kind == "empty" else 0o000)
    if kind == "unreadable" and os.access(key, os.R_OK):
        pytest.skip("this user reads files whatever their mode (root)")
    err = _cli(
        tmp_path, "run", "-np", "1", "--secure", "--key-file", str(key), *_marker_job(tmp_path)
    )
    line = _one_error(err)
    assert "--key-file: " in line and repr(str(key)) in line, err
    assert ("does not hold a job key" if kind == "empty" else "could not open") in line


def test_a_key_file_only_remote_ranks_read_is_theirs_to_check() -> None:
    """With every rank on other hosts, the launcher passes the path on and reads nothing."""
    remote = Config(secure=True, key_file="/only/on/the/nodes/job.key")
    command.check_settings(remote, {"secure", "key_file"}, ranks_here=False)
    with pytest.raises(SecurityError, match="--key-file: could not open"):
        command.check_settings(remote, {"secure", "key_file"}, ranks_here=True)
    # --secure alone: the launcher's own key reaches the ranks; RINGTRAIN_KEY_FILE goes unread
    command.check_settings(remote, {"secure"}, ranks_here=True)


@pytest.mark.parametrize(
    ("prog", "more"),
    [("run", ("-np", "1")), ("doctor", ()), ("bench allreduce", ()), ("k8s", ())],
)
@pytest.mark.timeout(90)
def test_an_unknown_flag_is_named_with_the_subcommands_usage(
    tmp_path: Path, prog: str, more: tuple[str, ...]
) -> None:
    job = _marker_job(tmp_path) if prog == "run" else []
    err = _cli(tmp_path, *prog.split(), "--bogus", *more, *job)
    assert err.startswith(f"usage: ringtrain {prog} "), err
    assert f"ringtrain {prog}: error: unrecognized arguments: --bogus\n" in err
    assert f"\nHINT: `ringtrain {prog} --help`" in err


@pytest.mark.timeout(90)
def test_flags_after_the_command_still_reach_it(tmp_path: Path) -> None:
    script = "import sys; print('argv', sys.argv[1:])"
    proc = subprocess.run(
        [PY, "-m", "ringtrain", "run", "-np", "1", PY, "-c", script, "--bogus", "-np", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "argv ['--bogus', '-np', '3']" in proc.stdout


# ---- bad hostfiles, --resume and ssh files: one error and a HINT, before any rank --------------


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot read hostfile"),  # missing
        ("DIR", "Is a directory"),
        ("localhost slots=x\n", "bad slot count in 'localhost slots=x'"),
        ("localhost slots=0\n", "a host needs at least 1 slot"),
        ("localhost:-1\n", "a host needs at least 1 slot"),
        ("localhost slots=1\nlocalhost slots=1\n", "host 'localhost' is listed twice"),
        ("\n# only a comment\n\n", "lists no hosts"),
        ("localhost slots=1 extra\n", "cannot parse 'localhost slots=1 extra'"),
        ("local!host slots=1\n", "bad host name in 'local!host slots=1'"),
    ],
)
def test_a_bad_hostfile_is_one_error_and_a_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, says: str
) -> None:
    hostfile = tmp_path / "hosts"
    if content == "DIR":
        hostfile.mkdir()
    elif content is not None:
        hostfile.write_text(content)
    line = _refused(tmp_path, capsys, "--hostfile", str(hostfile))
    assert says in line, line


def test_a_missing_resume_directory_is_refused_before_ranks_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank would fail loading it; an existing one is the ranks' to read."""
    missing = tmp_path / "ck"
    line = _refused(tmp_path, capsys, "--resume", str(missing))
    assert f"--resume {str(missing)!r}: {missing} does not exist" in line, line


@pytest.mark.parametrize("flag", ["identity_file", "config_file"])
def test_ssh_files_are_checked_where_ssh_reads_them(tmp_path: Path, flag: str) -> None:
    """Read by ssh on this host, only when it reaches other hosts: -H localhost uses none."""
    shown = "--ssh-" + flag.replace("_", "-")
    for path, says in ((tmp_path / "nosuch", "does not exist"), (tmp_path, "is a directory")):
        ssh = SshOptions(**{flag: str(path)})
        ssh_flags.check_ssh_files(ssh, remote=False)
        with pytest.raises(ConfigError, match=f"^{shown} .*{says}.\nHINT: "):
            ssh_flags.check_ssh_files(ssh, remote=True)
    given = tmp_path / "id"
    given.write_text("x")
    ssh_flags.check_ssh_files(SshOptions(**{flag: str(given)}), remote=True)


@pytest.mark.timeout(90)
def test_a_secure_resume_under_the_launchers_own_key_is_refused(tmp_path: Path) -> None:
    """``--secure --resume D`` without ``--key-file``: the launcher's fresh key opens no
    checkpoint of an earlier run, so every rank failed in its load ("failed authentication: it
    was changed, or sealed under another key") once the job had started."""
    (tmp_path / "ck").mkdir()
    flags = ("--secure", "--resume", str(tmp_path / "ck"))
    for env in ({}, {"RINGTRAIN_KEY_FILE": str(tmp_path / "job.key")}):  # the pipe wins
        err = _cli(tmp_path, "run", "-np", "1", *flags, *_marker_job(tmp_path), env=env)
        assert "in secure mode without --key-file" in _one_error(err), err
        assert "HINT: give the key file of the run that saved it" in err
    key = keys.write_key_file(tmp_path / "job.key", keys.generate_job_key())
    resume = str(tmp_path / "ck")
    command.check_settings(Config(secure=True, resume=resume, key_file=key), {"key_file"})
    env_secure = Config.from_env({"RINGTRAIN_SECURE": "1", "RINGTRAIN_KEY_FILE": key})
    command.check_settings(dataclasses.replace(env_secure, resume=resume), {"resume"})
    with pytest.raises(ConfigError, match="without --key-file"):  # RINGTRAIN_SECURE alone
        command.check_settings(Config(secure=True, resume=resume), {"resume"})
