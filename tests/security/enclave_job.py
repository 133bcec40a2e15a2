"""A real job for the enclave tests: every collective and a short training run, results saved.

Run by ``ringtrain run`` (inside or outside ``python -m ringtrain.testing.enclave``); each rank
writes ``rank<N>.pt`` into the directory given as the first argument.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from test_sealed_collectives import _collectives, _process_set
from test_secure_training import _train

import ringtrain as rt

rt.init()
results = {
    "backend": str(dist.get_backend()),
    "collectives": _collectives(),
    "process_set": _process_set(),
    "async": rt.synchronize(rt.allreduce_async(torch.ones(3) * rt.rank(), op=rt.Sum)),
    "weights": _train(6),
}
results["join"] = rt.join()
torch.save(results, f"{sys.argv[1]}/rank{rt.rank()}.pt")
print(f"saved {results['backend']}", flush=True)
rt.shutdown()
