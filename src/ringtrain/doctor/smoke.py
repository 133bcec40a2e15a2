"""The smoke job behind ``ringtrain run --check``: can every rank join and allreduce?

Each rank reports where it runs; rank 0 checks the sums of an allreduce, an allgather and a
broadcast, and prints one verdict line with the rendezvous and allreduce times.
"""

from __future__ import annotations

import socket
import sys
import time

import torch

from ringtrain import lifecycle
from ringtrain.collectives import ops
from ringtrain.runtime import queries


def main() -> int:
    t0 = time.perf_counter()
    lifecycle.init()
    joined = time.perf_counter() - t0
    rank, size = queries.rank(), queries.size()
    print(
        f"rank {rank}/{size} on {socket.gethostname()} (local {queries.local_rank()}/"
        f"{queries.local_size()}, cross {queries.cross_rank()}/{queries.cross_size()})",
        flush=True,
    )
    t1 = time.perf_counter()
    total = ops.allreduce(torch.full((1024,), float(rank + 1)), op="sum", name="smoke.allreduce")
    reduced = time.perf_counter() - t1
    gathered = ops.allgather(torch.tensor([rank]), name="smoke.allgather")
    root = ops.broadcast(torch.tensor([rank * 10]), root_rank=0, name="smoke.broadcast")
    expected = size * (size + 1) / 2
    ok = (
        bool(torch.all(total == expected))
        and gathered.tolist() == list(range(size))
        and root.item() == 0
    )
    lifecycle.shutdown()
    if rank == 0:
        verdict = "OK" if ok else "FAILED"
        print(
            f"ringtrain check {verdict}: {size} rank(s) joined in {joined:.2f} s, "
            f"allreduce of 4 KiB took {reduced * 1e3:.1f} ms",
            flush=True,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
