"""Serving or reaching the job's rendezvous store, without hanging on a port another program holds.

``torch.distributed.TCPStore`` alone hangs a rank whose peer's port is taken: the rank that
should serve the store fails, and a rank that reaches the port meets a program that accepts and
never answers, which TCPStore's own timeout does not bound (torch 2.13). :func:`connect` names
the port instead, in one error with a hint (``tests/runtime/test_store_port.py``).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time

import torch.distributed as dist

from ringtrain.errors import LaunchEnvironmentError

log = logging.getLogger("ringtrain")

# While nothing listens at the store's address: a warning this often; then what listens gets
# at most this long (or timeout_s, if shorter) to answer as a store.
SAY_EVERY_S, ANSWER_S = 30.0, 15.0


def connect(rank: int, addr: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The TCPStore at ``addr:port`` for ``rank``: served here (``is_master``) or reached.

    A port that another program holds must not hang the job: the rank that should serve the
    store fails at once naming the port, and a rank reaching it first waits for something to
    listen (a warning every ``SAY_EVERY_S``, up to ``timeout_s``), then gives what listens
    ``ANSWER_S`` to answer as a store. TCPStore's own timeout does not bound that answer: a
    listener that accepts and never replies holds its constructor forever (torch 2.13), so
    the constructor runs on a thread this rank stops waiting for.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"{addr}:{port}"
    if is_master:
        try:
            return dist.TCPStore(
                addr,
                port,
                world_size=None,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                use_libuv=True,
            )
        except (RuntimeError, OSError) as e:
            if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
                raise LaunchEnvironmentError(
                    f"rank {rank} could not serve the rendezvous store: port {port} on {addr} "
                    "is already in use by another program.\n"
                    f"HINT: choose a free port (MASTER_PORT, torchrun --master-port); "
                    f"`ss -ltnp 'sport = :{port}'` names the program that holds {port}."
                ) from None
            raise LaunchEnvironmentError(
                f"rank {rank} could not serve the rendezvous store at {where} ({e}).\n"
                "HINT: check that the address is this host's and the port is free; "
                "`ringtrain doctor` checks both."
            ) from e

    answer_s = min(timeout_s, ANSWER_S)
    start = time.monotonic()
    deadline, next_say = start + timeout_s, start + SAY_EVERY_S
    while True:  # something listening first: rank 0 may still be importing torch
        try:
            with socket.create_connection((addr, port), timeout=2.0):
                break  # a TCPStore server takes a connection that closes unused
        except socket.gaierror as e:
            raise LaunchEnvironmentError(
                f"rank {rank} cannot resolve the rendezvous address {addr!r} ({e.strerror}).\n"
                "HINT: MASTER_ADDR (or the launcher's address) must name rank 0's host as this "
                "host can resolve it, or be its IP address."
            ) from None
        except OSError:
            now = time.monotonic()
            if now >= deadline:
                raise LaunchEnvironmentError(
                    f"rank {rank} could not reach the rendezvous store at {where}: nothing "
                    f"listened there within timeout_s={timeout_s:g} s.\n"
                    "HINT: check that rank 0 started (its own error says why not), and that "
                    "this host reaches that address and port; `ringtrain doctor` checks both."
                ) from None
            if now >= next_say:
                next_say = now + SAY_EVERY_S
                log.warning(
                    "rank %d: still waiting for the rendezvous store at %s after %.0f s "
                    "(rank 0 or the launcher serves it; giving up after timeout_s=%g s)",
                    rank,
                    where,
                    now - start,
                    timeout_s,
                )
            time.sleep(0.2)

    made: list[dist.TCPStore | BaseException] = []

    def connect() -> None:
        try:
            made.append(
                dist.TCPStore(
                    addr,
                    port,
                    world_size=None,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=answer_s),
                    wait_for_workers=False,
                    use_libuv=True,
                )
            )
        except BaseException as e:  # handed to the waiting rank below
            made.append(e)

    thread = threading.Thread(target=connect, name="ringtrain-store-connect", daemon=True)
    thread.start()
    thread.join(answer_s + 2.0)
    if not made or isinstance(made[0], BaseException):
        why = f"no answer in {answer_s:g} s" if not made else f"{made[0]}".splitlines()[0]
        raise LaunchEnvironmentError(
            f"rank {rank}: what listens at {where} does not answer as a rendezvous store "
            f"({why}): another program most likely holds port {port}, so rank 0 could not "
            "serve the store there.\n"
            "HINT: choose a free port (MASTER_PORT, torchrun --master-port); "
            f"`ss -ltnp 'sport = :{port}'` on {addr} names the program that holds it."
        ) from None
    store = made[0]
    store.set_timeout(timeout)  # what every later wait on the store is bounded by
    return store
