"""The job's rendezvous store, run by ``ringtrain run`` as a child process.

The launcher imports no torch, so it starts this module instead of hosting a ``TCPStore`` itself.
It serves on the listening socket the launcher hands it (``--listen-fd``: bound and listening
before this process starts, so no other process can take the port meanwhile, and ranks that
connect early wait in its backlog), or binds ``--port`` itself; prints ``PORT <n>`` on stdout,
then serves until its stdin closes: the launcher holds that pipe, so the store lives exactly as long as the launcher.
Lines ``SET <key> <value>`` on stdin set keys: how the launcher, which has no store client,
announces elastic membership (:mod:`ringtrain.runtime.membership`); ``CHECK <key> ...`` answers
``HAVE <key> ...`` on stdout with those of the keys that are set (joining ranks' ready keys).
Hosting the store outside the ranks means rank 0 can fail or restart without taking the
rendezvous with it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringtrain.runtime.rendezvous_server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--listen-fd", type=int, default=None)
    args = parser.parse_args(argv)
    store = dist.TCPStore(
        "0.0.0.0",
        args.port,
        world_size=None,
        is_master=True,
        timeout=datetime.timedelta(seconds=args.timeout_s),
        wait_for_workers=False,
        master_listen_fd=args.listen_fd,
        use_libuv=True,
    )
    print(f"PORT {store.port}", flush=True)
    for line in sys.stdin:  # ends when the launcher closes the pipe or dies
        parts = line.rstrip("\n").split(" ", 2)
        if len(parts) == 3 and parts[0] == "SET":
            store.set(parts[1], parts[2])
        elif parts[0] == "CHECK":
            keys = line.split()[1:]
            print(" ".join(["HAVE", *(k for k in keys if store.check([k]))]), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown of torch (about 0.6 s of CPU, 0.4 s of it garbage
    # collection): the launcher waits for this process at the end of every job, and nothing here
    # holds data that teardown would save (the store lives in memory and ends with the job).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
