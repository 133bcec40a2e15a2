"""The training script the launcher tests start with real mpirun, torchrun and srun.

A tiny model trained for a few steps on data that differs per rank. Every rank prints one
``RESULT {json}`` line: its place in the job as ringtrain sees it, the launcher it detected,
whether every rank ended with the same weights (gathered, compared bit for bit) and whether
training moved them. Nothing here reads a launcher's variables: that is the point.
"""

import json
import os
import socket
import sys

import torch

torch.set_num_threads(1)

import ringtrain.torch as hvd  # noqa: E402
from ringtrain.runtime import state  # noqa: E402

hvd.init()
torch.manual_seed(100 + hvd.rank())  # different start per rank: the broadcast must fix that
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
data = torch.Generator().manual_seed(7 + hvd.rank())
for _ in range(5):
    x = torch.randn(16, 8, generator=data)
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
end = torch.cat([p.detach().flatten() for p in model.parameters()])
every = hvd.allgather(end.unsqueeze(0))
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
    "identical": all(torch.equal(every[0], every[r]) for r in range(hvd.size())),
    "trained": not torch.equal(start, end),
    "checksum": float(end.double().sum()),
}
hvd.shutdown()
# One write of the whole line (under PIPE_BUF, so atomic): the ranks share the launcher's stdout
# pipe, and a line written in pieces (text, then newline) can interleave with another rank's.
sys.stdout.flush()
os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
