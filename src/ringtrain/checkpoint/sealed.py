"""Sealed checkpoints (secure mode): every file AES-256-GCM under a key derived from the job key.

Two subkeys of the job key (HKDF-SHA256, :func:`ringtrain.security.keys.derive`): one seals the
files, one MACs the manifest (HMAC-SHA256), so neither key does both jobs. A sealed file is
``MAGIC | 12-byte random nonce | ciphertext and 16-byte tag``; the associated data is the file's
name inside the checkpoint, so a file moved to another name fails to open. The manifest lists
every sealed file's SHA-256 and is itself authenticated: a changed byte anywhere, or a file of
another checkpoint, is a :class:`SecurityError` or a :class:`CheckpointError` naming the file.

A checkpoint sealed by one job opens in another only with the same job key: for ``--resume``
of a secure job give both the same key (``RINGTRAIN_KEY_FILE``), since ``ringtrain run
--secure`` makes a fresh key per run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringtrain.errors import SecurityError
from ringtrain.security import keys

if TYPE_CHECKING:
    from ringtrain.config import Config

MAGIC = b"RTCKPT1\x00"
NONCE = 12
FILES = "checkpoint-files"
MANIFEST = "checkpoint-manifest"


@dataclass(frozen=True)
class Keys:
    files: bytes
    manifest: bytes


def derive(job_key: bytes) -> Keys:
    return Keys(keys.derive(job_key, FILES), keys.derive(job_key, MANIFEST))


def job_keys(config: Config) -> Keys | None:
    """This job's checkpoint keys in secure mode, None otherwise."""
    if not getattr(config, "secure", False):
        return None
    from ringtrain.transport import sealed_backend

    ctx = sealed_backend._context
    key = ctx.job_key if ctx is not None else keys.load_job_key(config)
    return derive(key)


def _aad(name: str) -> bytes:
    return b"ringtrain/checkpoint/v1\x00" + name.encode()


def seal(key: bytes, name: str, data: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(NONCE)
    return MAGIC + nonce + AESGCM(key).encrypt(nonce, data, _aad(name))


class Sealer:
    """:func:`seal` a file as it streams to disk (:class:`ringtrain.checkpoint.layout.Transform`):
    the same bytes as the one-shot form (GCM's ciphertext, then its tag), without the whole file
    in memory twice, and without the one-shot form's 2 GiB limit."""

    def __init__(self, key: bytes, name: str) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._nonce = os.urandom(NONCE)
        self._enc = Cipher(algorithms.AES(key), modes.GCM(self._nonce)).encryptor()
        self._enc.authenticate_additional_data(_aad(name))

    def begin(self) -> bytes:
        return MAGIC + self._nonce

    def update(self, data: memoryview) -> bytes:
        return self._enc.update(data)

    def end(self) -> bytes:
        return self._enc.finalize() + self._enc.tag


def open_sealed(key: bytes, name: str, path: str, blob: bytes) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + NONCE + 16:
        raise SecurityError(
            f"{path} is not a sealed checkpoint file (no header).\n"
            "HINT: the file was replaced or truncated; load an earlier checkpoint."
        )
    nonce = blob[len(MAGIC) : len(MAGIC) + NONCE]
    try:
        return AESGCM(key).decrypt(nonce, blob[len(MAGIC) + NONCE :], _aad(name))
    except InvalidTag:
        raise SecurityError(
            f"{path} failed authentication: it was changed, or sealed under another key.\n"
            "HINT: load it with the job key it was saved under; otherwise it cannot be trusted."
        ) from None
