"""The training script the launcher tests start with real mpirun, torchrun and srun.

A tiny model trained for a few steps on data that differs per rank. Every rank prints one
``RESULT {json}`` line: its place in the job as ringtrain sees it, the launcher it detected,
whether every rank ended with the same weights (gathered, compared bit for bit) and whether
training moved them. Nothing here reads a launcher's variables: that is the point.
"""

import socket
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _training

import ringtrain.torch as hvd  # noqa: E402
from _training import print_result, tiny_job  # noqa: E402
from ringtrain.runtime import state  # noqa: E402

hvd.init()
trained = tiny_job()
result = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(),
    "cross_size": hvd.cross_size(),
    "host": socket.gethostname(),
    "ringtrain_host": state.current().topology.hosts[hvd.rank()],
    "launcher": state.current().placement.launcher,
    **trained,
}
hvd.shutdown()
print_result(result)
