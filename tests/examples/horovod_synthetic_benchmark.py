# Our re-creation of the API surface of Horovod's examples/pytorch/pytorch_synthetic_benchmark.py
# (flags, init, DistributedOptimizer with compression, broadcasts, timing loop), written for
# Horovod; the test swaps only the import line. local_models stands in for torchvision.models.
import argparse
import timeit

import horovod.torch as hvd
import local_models as models
import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark")
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--model", type=str, default="tiny_resnet")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)
parser.add_argument("--no-cuda", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()
torch.set_num_threads(1)
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())

model = getattr(models, args.model)()
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    compression=compression,
    op=hvd.Adasum if args.use_adasum else hvd.Average,
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, 32, 32)
target = torch.randint(0, 10, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


device = "GPU" if args.cuda else "CPU"
log(f"Model: {args.model}")
log(f"Batch size: {args.batch_size}")
log(f"Number of {device}s: {hvd.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / t
    log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
    img_secs.append(img_sec)
img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
log(f"Total img/sec on {hvd.size()} {device}(s): {hvd.size() * img_sec_mean:.1f}")
# Not in Horovod's script: lets the test see that every rank ends with the same weights.
print(f"weights {sum(p.double().sum().item() for p in model.parameters()):.12e}")
