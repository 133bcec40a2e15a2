"""The job key: made by the launcher, handed to ranks out of band, and split into subkeys.

How a key flows:

* ``ringtrain run --secure`` calls :func:`generate_job_key` (32 random bytes from ``secrets``) and
  gives every rank a pipe whose read end is inherited: ``RINGTRAIN_KEY_FD=<fd>`` names the
  descriptor (a number, not a secret), the pipe carries :func:`encode_key`'s line (64 lowercase
  hex characters and a newline), then EOF. The key is never in argv, in the environment, or in
  a file.
* Jobs started by torchrun, Slurm or Kubernetes set ``RINGTRAIN_KEY_FILE`` (``Config.key_file``)
  to a file only its owner can read (e.g. a Kubernetes Secret mounted with ``defaultMode: 0400``),
  holding the key as hex or as 32 raw bytes.

Nothing uses the job key directly: :func:`derive` makes one independent subkey per purpose with
HKDF-SHA256 (RFC 5869), so the key that authenticates the rendezvous never seals data and vice
versa. This module imports nothing heavy (no torch): the launcher imports it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Mapping
from typing import Any

from ringtrain import environ
from ringtrain.environ import Ringtrain
from ringtrain.errors import ConfigError, SecurityError

KEY_BYTES = 32
KEY_FD_VAR = Ringtrain.KEY_FD
# Subkey purposes. Changing a label changes every derived key: it is part of the protocol.
RENDEZVOUS = "rendezvous"
SEALING = "sealing"
NOTES = "notes"

# A key read from RINGTRAIN_KEY_FD: the pipe can be read once, but init() may run many times.
_from_fd: dict[int, bytes] = {}


def generate_job_key() -> bytes:
    """A fresh random job key (32 bytes from the OS's CSPRNG)."""
    return secrets.token_bytes(KEY_BYTES)


def encode_key(key: bytes) -> bytes:
    """The line a launcher writes into a rank's key pipe: 64 lowercase hex chars and a newline."""
    _check_length(key, "encode_key")
    return key.hex().encode("ascii") + b"\n"


def write_key_file(path: str | os.PathLike[str], key: bytes) -> str:
    """Write ``key`` as a hex line to a new file only its owner can read (mode 600)."""
    line = encode_key(key)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, line)
    finally:
        os.close(fd)
    return os.fspath(path)


def decode_key(data: bytes, where: str) -> bytes:
    """A key from hex text (surrounding whitespace ignored) or exactly 32 raw bytes."""
    text = data.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    if len(data) == KEY_BYTES:
        return bytes(data)
    if len(text) == 2 * KEY_BYTES:
        got = f"{len(text)} characters that are not all hex digits (0-9, a-f)"
    elif text[:2].lower() == b"0x":
        got = f"{len(text)} characters starting with 0x (write the hex digits alone)"
    else:
        got = f"{len(data)} bytes ({len(text)} without surrounding whitespace)"
    raise SecurityError(
        f"{where} does not hold a job key: got {got}, expected {2 * KEY_BYTES} hex "
        f"characters or {KEY_BYTES} raw bytes.\n"
        "HINT: create one with `python -c 'import secrets; print(secrets.token_hex(32))' > key` "
        "and `chmod 600 key`."
    )


def load_job_key(config: Any, env: Mapping[str, str] | None = None) -> bytes:
    """This rank's job key: from the launcher's pipe (``RINGTRAIN_KEY_FD``), else ``key_file``.

    ``config`` is a :class:`ringtrain.config.Config` (only ``key_file`` is read). The pipe is read
    to EOF and closed; the key is kept for later ``init()`` calls of this process. A key file must
    not be readable by group or others. Raises :class:`SecurityError` when no key is available.
    """
    env = environ.current() if env is None else env
    raw_fd = env.get(KEY_FD_VAR, "").strip()
    if raw_fd:
        return _read_fd(raw_fd)
    path = getattr(config, "key_file", "")
    if path:
        return _read_file(path)
    raise SecurityError(
        "secure mode needs a job key, but none was given: RINGTRAIN_KEY_FD is unset and "
        "key_file is empty.\n"
        "HINT: start the job with `ringtrain run --secure` (it makes and hands over a key), or "
        "set RINGTRAIN_KEY_FILE to a file readable only by you holding a 32-byte key in hex."
    )


def derive(key: bytes, purpose: str, context: bytes = b"", length: int = KEY_BYTES) -> bytes:
    """An independent subkey of ``key`` for ``purpose`` (HKDF-SHA256), bound to ``context``."""
    # Imported here: jobs that seal nothing import this module (through the TCP backend's
    # ring groups) and must run where `cryptography` is not installed.
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    _check_length(key, "derive")
    info = b"ringtrain/v1/" + purpose.encode() + b"\x00" + context
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(key)


def _check_length(key: bytes, what: str) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        got = len(key) if isinstance(key, bytes | bytearray) else type(key).__name__
        raise SecurityError(f"{what} needs a {KEY_BYTES}-byte key, got {got}")


def _read_fd(raw_fd: str) -> bytes:
    try:
        fd = int(raw_fd)
    except ValueError:
        raise ConfigError(
            f"{KEY_FD_VAR}={raw_fd!r} is not a file descriptor number.\n"
            "HINT: this variable is set by `ringtrain run --secure`; do not set it by hand."
        ) from None
    if fd in _from_fd:
        # Read and closed by an earlier init(): the number may now be one of the script's own
        # files, which must not be read or closed. A process handed a new key on a new pipe
        # (a reused Ray actor) calls forget_pipe_keys() first.
        return _from_fd[fd]
    chunks = []
    try:
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError as e:
        raise SecurityError(
            f"could not read the job key from {KEY_FD_VAR}={fd} ({e.strerror}).\n"
            "HINT: the launcher's key pipe is read once per process; a child process must "
            "get its own (or use RINGTRAIN_KEY_FILE)."
        ) from e
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    key = decode_key(b"".join(chunks), f"the key pipe {KEY_FD_VAR}={fd}")
    _from_fd[fd] = key
    return key


def forget_pipe_keys() -> None:
    """Forget the keys read from ``RINGTRAIN_KEY_FD``: the next :func:`load_job_key` reads the
    pipe it names (a process given a new job's key, as a reused Ray actor is)."""
    _from_fd.clear()


def check_key_file(path: str) -> None:
    """Raise :class:`SecurityError` unless ``path`` holds a job key only its owner can access
    (what ``ringtrain run`` checks before starting ranks)."""
    _read_file(path)


def _read_file(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise SecurityError(
            f"could not open the key file {path!r} ({e.strerror}).\n"
            "HINT: check RINGTRAIN_KEY_FILE / key_file and that the file is mounted on this host."
        ) from e
    try:
        st = os.fstat(fd)  # of the opened file, so a swapped path cannot fool the check
        if not stat.S_ISREG(st.st_mode):
            raise SecurityError(
                f"the key file {path!r} is not a file (a directory, a device or a pipe).\n"
                "HINT: name the file that holds the key (Kubernetes: the Secret's file inside "
                "its mount, e.g. /etc/ringtrain/job.key, not the mount)."
            )
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecurityError(
                f"the key file {path!r} has mode {stat.S_IMODE(st.st_mode):o}: group or others "
                "may access it, expected access for its owner only.\n"
                f"HINT: run `chmod 600 {path}` (Kubernetes: mount the Secret with "
                "`defaultMode: 0400` in a pod without `fsGroup`, which makes it 0440)."
            )
        data = b""
        while len(data) < 4096:
            try:
                chunk = os.read(fd, 4096)
            except OSError as e:
                raise SecurityError(f"could not read the key file {path!r} ({e.strerror})") from e
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    return decode_key(data, f"the key file {path!r}")
