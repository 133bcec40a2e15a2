"""Sealed notes: the store values that carry a user's words, unreadable without the job key.

The rendezvous store is plaintext (docs/security.md). What ranks post there is mostly protocol
(nonces, proofs, counters, step numbers), but two posts carry a user's words: the names of
collectives that wait (:mod:`ringtrain.collectives.crossset`) and the message of an uncaught
exception (:mod:`ringtrain.runtime.departures`), which often quotes data. In secure mode those
values are sealed with AES-256-GCM under a subkey of the job key, bound to the store key they
are posted under, so that an attacker on the network can neither read them nor move one to
another key. An old value may still be put back (the store keeps no sequence): a diagnostic then
reads stale but authentic words.
"""

from __future__ import annotations

import os

from ringtrain.errors import SecurityError
from ringtrain.security import keys

NONCE = 12
_AAD = b"ringtrain/notes/v1\x00"


class Notes:
    """Seals and opens store values; without a key (plain mode) both return the value as is."""

    def __init__(self, job_key: bytes | None = None) -> None:
        self._key = keys.derive(job_key, keys.NOTES) if job_key is not None else None

    @property
    def sealed(self) -> bool:
        return self._key is not None

    def seal(self, where: str, value: bytes) -> bytes:
        """``value`` as posted under store key ``where``."""
        if self._key is None:
            return value
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        nonce = os.urandom(NONCE)
        return nonce + AESGCM(self._key).encrypt(nonce, value, _AAD + where.encode())

    def open(self, where: str, posted: bytes) -> bytes:
        """What :meth:`seal` sealed, read back from store key ``where``; a value that does not
        open (forged, moved from another key, or posted in plain mode) raises SecurityError."""
        if self._key is None:
            return posted
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        try:
            return AESGCM(self._key).decrypt(posted[:NONCE], posted[NONCE:], _AAD + where.encode())
        except (InvalidTag, ValueError):
            raise SecurityError(
                f"the store value at {where!r} is not sealed with this job's key"
            ) from None


PLAIN = Notes()
