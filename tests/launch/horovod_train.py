# A training script written for Horovod, as users have them. The test swaps only the import line.
import argparse
import os

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--checkpoint", default="checkpoint.pt")
args = parser.parse_args()

hvd.init()
torch.manual_seed(1234)
torch.set_num_threads(1)

# y = X @ w_true + noise, the same data on every rank; each rank reads its own shard.
X = torch.randn(512, 8)
y = X @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.01 * torch.randn(512, 1)
dataset = TensorDataset(X, y)
sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
loader = DataLoader(dataset, batch_size=32, sampler=sampler)

torch.manual_seed(hvd.rank())  # different initial weights per rank: broadcast must fix that
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * hvd.size())

hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
optimizer = hvd.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    compression=hvd.Compression.none,
    op=hvd.Average,
)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


first = None
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    model.train()
    total = 0.0
    for data, target in loader:
        optimizer.zero_grad()
        loss = F.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        total += loss.item()
    avg = metric_average(total / len(loader), "avg_loss")
    first = avg if first is None else first
    if hvd.rank() == 0:
        print(f"epoch {epoch} loss {avg:.4f} size {hvd.size()} local_rank {hvd.local_rank()}")
        torch.save({"model": model.state_dict(), "epoch": epoch}, args.checkpoint)

# Every rank ends with the same weights.
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = hvd.allgather(flat.unsqueeze(0))
assert torch.allclose(gathered, gathered[0].expand_as(gathered)), "weights diverged"
assert avg < first, f"loss did not go down: {first} -> {avg}"
if hvd.rank() == 0:
    print("DONE", os.path.exists(args.checkpoint))
