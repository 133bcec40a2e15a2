"""The job key: generated fresh, handed over by pipe (never argv or env), loaded from a private
file only, and split into independent subkeys."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.config import Config
from ringtrain.errors import SecurityError
from ringtrain.security import keys


def test_generated_keys_are_fresh_and_encoded_as_one_hex_line() -> None:
    a, b = keys.generate_job_key(), keys.generate_job_key()
    assert len(a) == 32 and a != b
    line = keys.encode_key(a)
    assert line == a.hex().encode() + b"\n"
    assert keys.decode_key(line, "test") == a


def test_key_from_pipe_is_read_once_and_closed() -> None:
    keys.forget_pipe_keys()
    key = keys.generate_job_key()
    r, w = os.pipe()
    os.write(w, keys.encode_key(key))
    os.close(w)
    env = {keys.KEY_FD_VAR: str(r)}
    assert keys.load_job_key(Config(), env) == key
    with pytest.raises(OSError):
        os.fstat(r)  # the pipe was closed after reading
    assert keys.load_job_key(Config(), env) == key  # a second init() reuses it


def test_a_child_gets_the_key_by_pipe_not_argv_or_env() -> None:
    key = keys.generate_job_key()
    r, w = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}
    env[keys.KEY_FD_VAR] = str(r)
    code = (
        "import sys; from ringtrain.config import Config; from ringtrain.security import keys;"
        "k = keys.load_job_key(Config()); import os;"
        "print(k.hex()); print(repr(sys.argv)); print(repr(dict(os.environ)))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, pass_fds=(r,), stdout=subprocess.PIPE, text=True
    )
    os.close(r)
    os.write(w, keys.encode_key(key))
    os.close(w)
    out, _ = proc.communicate(timeout=60)
    got, argv, child_env = out.splitlines()[:3]
    assert got == key.hex()
    assert key.hex() not in argv and key.hex() not in child_env


def test_key_file_hex_or_raw(tmp_path: Path) -> None:
    key = keys.generate_job_key()
    path = keys.write_key_file(tmp_path / "hex.key", key)
    assert keys.load_job_key(Config(key_file=path), {}) == key
    raw = tmp_path / "raw.key"
    fd = os.open(raw, os.O_WRONLY | os.O_CREAT, 0o400)
    os.write(fd, key)
    os.close(fd)
    assert keys.load_job_key(Config(key_file=str(raw)), {}) == key


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_key_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = keys.write_key_file(tmp_path / "open.key", keys.generate_job_key())
    os.chmod(path, mode)
    with pytest.raises(SecurityError, match="chmod 600"):
        keys.load_job_key(Config(key_file=path), {})


def test_missing_and_malformed_keys(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="none was given"):
        keys.load_job_key(Config(), {})
    bad = tmp_path / "bad.key"
    fd = os.open(bad, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a key\n")
    os.close(fd)
    with pytest.raises(SecurityError, match="does not hold a job key"):
        keys.load_job_key(Config(key_file=str(bad)), {})


def test_subkeys_are_independent_per_purpose() -> None:
    key = keys.generate_job_key()
    a = keys.derive(key, keys.RENDEZVOUS)
    b = keys.derive(key, keys.SEALING)
    assert len(a) == len(b) == 32 and len({a, b, key}) == 3
    assert keys.derive(key, keys.SEALING, b"x") != b
    assert keys.derive(key, keys.SEALING) == b  # deterministic: every rank derives the same


def test_a_later_init_never_reads_a_file_that_took_the_pipe_s_number(tmp_path: Path) -> None:
    # The pipe is closed after the first read: its number may then be one of the script's own
    # files, which a second init() read to EOF and closed (a user's file lost its descriptor).
    keys.forget_pipe_keys()  # an earlier test's pipe may have had this number
    key = keys.generate_job_key()
    r, w = os.pipe()
    os.write(w, keys.encode_key(key))
    os.close(w)
    env = {keys.KEY_FD_VAR: str(r)}
    try:
        assert keys.load_job_key(Config(), env) == key
        user = os.open(tmp_path / "user.txt", os.O_RDWR | os.O_CREAT, 0o600)
        assert user == r  # the lowest free number: the pipe's
        os.write(user, b"the script's data")
        assert keys.load_job_key(Config(), env) == key
        os.fstat(user)  # still open
        assert os.pread(user, 64, 0) == b"the script's data"
        os.close(user)
        # A process handed a new job's key on a new pipe reads it once told to.
        new = keys.generate_job_key()
        r2, w2 = os.pipe()
        os.write(w2, keys.encode_key(new))
        os.close(w2)
        keys.forget_pipe_keys()
        assert keys.load_job_key(Config(), {keys.KEY_FD_VAR: str(r2)}) == new
    finally:
        keys.forget_pipe_keys()


def test_key_files_that_are_not_keys_say_what_they_hold(tmp_path: Path) -> None:
    folder = tmp_path / "mount"
    folder.mkdir(mode=0o700)
    with pytest.raises(SecurityError, match="is not a file"):
        keys.load_job_key(Config(key_file=str(folder)), {})
    for text, said in (
        (b"z" * 64 + b"\n", "64 characters that are not all hex digits"),
        (b"0x" + b"ab" * 32 + b"\n", "starting with 0x"),
        (b"ab" * 20 + b"\n", "41 bytes (40 without surrounding whitespace)"),
    ):
        path = tmp_path / "bad.key"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, text)
        os.close(fd)
        with pytest.raises(SecurityError, match=re.escape(said)):
            keys.load_job_key(Config(key_file=str(path)), {})
