"""The job's rendezvous store, run by ``ringtrain run`` as a child process.

The launcher imports no torch, so it starts this module instead of hosting a store itself; the
store is :mod:`ringtrain.runtime.store_server`, torch's TCPStore protocol in plain Python, so
this process does not import torch either (1.5-2 s of CPU a job).
It serves on the listening socket the launcher hands it (``--listen-fd``: bound and listening
before this process starts, so no other process can take the port meanwhile, and ranks that
connect early wait in its backlog), or binds ``--port`` itself; prints ``PORT <n>`` on stdout,
then serves until its stdin closes: the launcher holds that pipe, so the store lives exactly as long as the launcher.
Lines ``SET <key> <value>`` on stdin set keys: how the launcher, which has no store client,
announces elastic membership (:mod:`ringtrain.runtime.membership`); ``CHECK <n> <key> ...`` answers
``HAVE <n> <key> ...`` on stdout with those of the keys that are set (joining ranks' ready keys,
ranks' re-form requests); ``n`` numbers the question, so that a late answer is never taken for
a later question's.
Hosting the store outside the ranks means rank 0 can fail or restart without taking the
rendezvous with it. It ignores SIGTERM and SIGHUP for the same reason: Slurm signals every
process of a cancelled job, this one too, while the ranks still need the store to agree on the
step they stop at and save.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys

from ringtrain.runtime.store_server import StoreServer

KEY_PREFIX = b"/"  # torch's TCPStore clients put it before every key they send


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.runtime.rendezvous_server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)  # kept for callers; unused
    parser.add_argument("--listen-fd", type=int, default=None)
    args = parser.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the launcher's pipe alone ends this process
    if args.listen_fd is not None:
        listener = socket.socket(fileno=args.listen_fd)
    else:
        dual = socket.has_dualstack_ipv6()
        family = socket.AF_INET6 if dual else socket.AF_INET
        listener = socket.create_server(
            ("", args.port), family=family, backlog=1024, dualstack_ipv6=dual
        )
    server = StoreServer(listener)

    def on_line(raw: bytes) -> None:
        line = raw.decode()
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] == "SET":
            server.set(KEY_PREFIX + parts[1].encode(), parts[2].encode())
        elif parts[0] == "CHECK" and len(parts) > 1:
            number, *keys = line.split()[1:]
            have = [k for k in keys if server.check([KEY_PREFIX + k.encode()])]
            print(" ".join(["HAVE", number, *have]), flush=True)

    print(f"PORT {server.port}", flush=True)
    server.watch(sys.stdin.fileno(), on_line)  # ends when the launcher closes the pipe or dies
    server.serve()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
