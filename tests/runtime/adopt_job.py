"""A script that creates torch's default process group itself, then calls ``hvd.init()``, as
scripts under Ray Train, Lightning or Accelerate do. Started by real torchrun
(tests/runtime/test_adopt.py); every rank prints one ``RESULT {json}`` line.

``argv[1]``: ``store`` (the group's own store carries ringtrain's groups) or ``nostore`` (the
store is hidden, as an MPI-backend group has none: rank 0 serves one and sends its address
through the group).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")  # the user's group, from torchrun's variables

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for _training

import ringtrain.torch as hvd  # noqa: E402
from _training import print_result, tiny_job  # noqa: E402
from ringtrain.runtime import state  # noqa: E402

if sys.argv[1] == "nostore":
    dist.distributed_c10d._get_default_store = lambda: None  # type: ignore[assignment]

user_group = dist.group.WORLD
hvd.init()
assert dist.group.WORLD is user_group, "ringtrain replaced the script's default group"
trained = tiny_job()
summed = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="sum")
result = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "dist_rank": dist.get_rank(),
    "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(),
    "launcher": state.current().placement.launcher,
    "adopted": state.current().adopted,
    "sum": summed.item(),
    **trained,
}
hvd.shutdown()
# Horovod's shutdown leaves torch.distributed alone: the script's group still works ...
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
result["after_shutdown"] = t.item()
# ... and ringtrain can join again beside it.
hvd.init()
result["again"] = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="again").item()
hvd.shutdown()
dist.destroy_process_group()
print_result(result)
