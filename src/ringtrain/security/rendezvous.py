"""Authenticated rendezvous: every rank proves it holds the job key before any group is built.

The rendezvous store (a TCPStore) is reachable by anyone who can reach its port, and its traffic
is not encrypted. So nothing secret goes through it, and the job's own keys live under a prefix
derived from the key (:func:`job_prefix`): a process without the key cannot find them, let alone
overwrite them. Before that, a challenge-response over a public area of the store admits ranks:

1. a joining rank r draws a nonce ``Nr`` and appends ``Nr host`` to ``auth/queue/r``;
2. rank 0 answers each new attempt with its own nonce ``N0`` and
   ``HMAC(K, "rank0" | job | r | Nr | N0)``: proof that rank 0 holds the key, bound to this
   attempt (so it cannot be replayed to another);
3. the joiner checks it, then answers ``HMAC(K, "joiner" | job | r | Nr | N0)``;
4. rank 0 checks that and writes the verdict. Attempts that fail are rejected, and rank 0 keeps
   waiting for rank r: a stranger (or a rank with the wrong key) gets a clear
   :class:`~ringtrain.errors.SecurityError`, and the job is not disturbed. When every rank is
   admitted rank 0 writes ``auth/admitted``; if the timeout passes first it writes
   ``auth/failed`` with the reason, so every waiting rank fails with the same message.

``K`` is the rendezvous subkey (:func:`ringtrain.security.keys.derive`), never the sealing key.
Only nonces and MACs travel, never the key. The store is duck-typed (``set``, ``get``,
``check``, ``append``); nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ringtrain.errors import SecurityError
from ringtrain.security import keys

log = logging.getLogger("ringtrain")

POLL_S = 0.02
NONCE_BYTES = 16


def job_prefix(job_key: bytes, job_id: str) -> str:
    """The store prefix of the job's keys: unguessable without the key."""
    k = keys.derive(job_key, keys.RENDEZVOUS, b"prefix")
    return "job-" + hmac.new(k, job_id.encode(), hashlib.sha256).hexdigest()[:32]


def _proof(k: bytes, role: str, job_id: str, rank: int, joiner: bytes, server: bytes) -> bytes:
    msg = b"|".join([role.encode(), job_id.encode(), str(rank).encode(), joiner, server])
    return hmac.new(k, msg, hashlib.sha256).digest()


@dataclass
class _Attempt:
    rank: int
    nonce: bytes
    host: str
    server_nonce: bytes = b""
    done: bool = False


@dataclass
class _Admission:
    """Rank 0's bookkeeping while ranks join."""

    admitted: dict[int, str] = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)
    seen: dict[int, int] = field(default_factory=dict)  # bytes of each queue already read
    waiting: dict[str, _Attempt] = field(default_factory=dict)


def authenticate(
    store: Any,
    job_key: bytes,
    job_id: str,
    rank: int,
    size: int,
    host: str,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Run this rank's side of the handshake; returns once every rank is admitted."""
    if size == 1:
        return
    k = keys.derive(job_key, keys.RENDEZVOUS, b"handshake")
    if rank == 0:
        _admit_all(store, k, job_id, size, timeout_s, clock)
    else:
        _join(store, k, job_id, rank, host, timeout_s, clock)


def _join(
    store: Any,
    k: bytes,
    job_id: str,
    rank: int,
    host: str,
    timeout_s: float,
    clock: Callable[[], float],
) -> None:
    nonce = os.urandom(NONCE_BYTES)
    attempt = nonce.hex()
    store.append(f"auth/queue/{rank}", f"{attempt} {host}\n".encode())
    deadline = clock() + timeout_s
    reply = _await(store, f"auth/reply/{rank}/{attempt}", deadline, clock, rank)
    server_nonce, server_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
    expected = _proof(k, "rank0", job_id, rank, nonce, server_nonce)
    if not hmac.compare_digest(server_proof, expected):
        store.set(f"auth/resp/{rank}/{attempt}", b"rank 0's proof did not verify")
        raise SecurityError(
            f"rank {rank} (host {host}) could not verify rank 0's proof of the job key: this "
            "rank and rank 0 hold different keys, or someone else answered as rank 0.\n"
            "HINT: start every rank with the same key (ringtrain run --secure hands one out; "
            "otherwise check RINGTRAIN_KEY_FILE on every host)."
        )
    store.set(f"auth/resp/{rank}/{attempt}", _proof(k, "joiner", job_id, rank, nonce, server_nonce))
    verdict = _await(store, f"auth/verdict/{rank}/{attempt}", deadline, clock, rank).decode()
    if verdict != "ok":
        raise SecurityError(f"rank 0 rejected rank {rank} (host {host}): {verdict}")
    _await(store, "auth/admitted", deadline, clock, rank)


def _await(store: Any, key: str, deadline: float, clock: Callable[[], float], rank: int) -> bytes:
    """The value of ``key`` once set; fails at the deadline or when rank 0 reports failure."""
    while True:
        if store.check([key]):
            return bytes(store.get(key))
        if store.check(["auth/failed"]):
            raise SecurityError(store.get("auth/failed").decode(errors="replace"))
        if clock() > deadline:
            raise SecurityError(
                f"rank {rank} got no answer from rank 0 in the authenticated rendezvous "
                f"(waited for {key!r}).\nHINT: check that rank 0 runs and is in secure mode "
                "too; a job that already started admits nobody else."
            )
        time.sleep(POLL_S)


def _admit_all(
    store: Any, k: bytes, job_id: str, size: int, timeout_s: float, clock: Callable[[], float]
) -> None:
    state = _Admission()
    deadline = clock() + timeout_s
    while len(state.admitted) < size - 1:
        for r in range(1, size):
            _read_queue(store, k, job_id, r, state)
        for attempt in list(state.waiting.values()):
            _check_response(store, k, job_id, attempt, state)
        if len(state.admitted) == size - 1:
            break
        if clock() > deadline:
            missing = [r for r in range(1, size) if r not in state.admitted]
            why = f"ranks {missing} did not prove they hold the job key within {timeout_s:g} s" + (
                f"; rejected attempts: {'; '.join(state.rejected)}" if state.rejected else ""
            )
            store.set("auth/failed", why.encode())
            raise SecurityError(
                f"{why}.\nHINT: a rejected attempt comes from a process with another key; a "
                "missing rank never reached the rendezvous (see its log)."
            )
        time.sleep(POLL_S)
    store.set("auth/admitted", b"1")
    if state.rejected:
        log.warning("authenticated rendezvous rejected: %s", "; ".join(state.rejected))


def _read_queue(store: Any, k: bytes, job_id: str, r: int, state: _Admission) -> None:
    key = f"auth/queue/{r}"
    if not store.check([key]):
        return
    raw = bytes(store.get(key))
    new, state.seen[r] = raw[state.seen.get(r, 0) :], len(raw)
    for line in new.decode(errors="replace").splitlines():
        attempt, _, host = line.partition(" ")
        try:
            nonce = bytes.fromhex(attempt)
        except ValueError:
            continue
        if len(nonce) != NONCE_BYTES:
            continue
        if r in state.admitted:
            store.set(f"auth/verdict/{r}/{attempt}", f"rank {r} has already joined".encode())
            state.rejected.append(f"rank {r} from host {host or '?'}: rank already joined")
            continue
        a = _Attempt(r, nonce, host, os.urandom(NONCE_BYTES))
        proof = _proof(k, "rank0", job_id, r, nonce, a.server_nonce)
        store.set(f"auth/reply/{r}/{attempt}", a.server_nonce + proof)
        state.waiting[attempt] = a


def _check_response(store: Any, k: bytes, job_id: str, a: _Attempt, state: _Admission) -> None:
    attempt = a.nonce.hex()
    key = f"auth/resp/{a.rank}/{attempt}"
    if not store.check([key]):
        return
    del state.waiting[attempt]
    got = bytes(store.get(key))
    good = hmac.compare_digest(got, _proof(k, "joiner", job_id, a.rank, a.nonce, a.server_nonce))
    if good and a.rank not in state.admitted:
        state.admitted[a.rank] = a.host
        store.set(f"auth/verdict/{a.rank}/{attempt}", b"ok")
        return
    reason = "its proof of the job key did not verify (wrong key)" if not good else "duplicate"
    state.rejected.append(f"rank {a.rank} from host {a.host or '?'}: {reason}")
    store.set(f"auth/verdict/{a.rank}/{attempt}", reason.encode())
    log.warning("rejected a process claiming rank %d from host %s: %s", a.rank, a.host, reason)
