"""A plain ringtrain training script, run unchanged by Spark's TorchDistributor (which starts
torchrun in each Spark task). Every rank writes ``<argv[1]>/rank<N>.json``: its place in the job,
whether every rank ended with the same weights and whether training moved them."""

import json
import sys
from pathlib import Path

import torch

import ringtrain.torch as hvd
from ringtrain.runtime import state

torch.set_num_threads(1)
hvd.init()
torch.manual_seed(100 + hvd.rank())
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
    "local_size": hvd.local_size(),
    "cross_size": hvd.cross_size(),
    "launcher": state.current().placement.launcher,
    "identical": all(torch.equal(every[0], every[r]) for r in range(hvd.size())),
    "trained": not torch.equal(start, end),
}
hvd.shutdown()
Path(sys.argv[1], f"rank{result['rank']}.json").write_text(json.dumps(result))
