# Our re-creation of the API surface of Horovod's examples/pytorch/pytorch_mnist.py (flags,
# init, FileLock around the dataset, DistributedSampler with num_replicas=hvd.size(),
# broadcasts, DistributedOptimizer with compression and gradient_predivide_factor,
# metric_average via allreduce), written for Horovod; the test swaps only the import line.
# digits_mnist/local_models stand in for torchvision's datasets/transforms and the Net.
import argparse
import os

import digits_mnist as datasets
import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from filelock import FileLock
from local_models import MnistNet as Net

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--no-cuda", action="store_true", default=False)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--data-dir")


def train(args):
    def train_epoch(epoch):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                print(
                    f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]"
                    f"\tLoss: {loss.item():.6f}"
                )

    def metric_average(val, name):
        return hvd.allreduce(torch.tensor(val), name=name).item()

    def test():
        model.eval()
        test_loss = test_accuracy = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).float().sum().item()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        # Not in Horovod's script: each rank's own figures, so the test can check the average.
        print(f"local loss {test_loss!r} accuracy {test_accuracy!r}")
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"Test set: Average loss: {test_loss!r}, Accuracy: {test_accuracy!r}")

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    data_dir = args.data_dir or "./data"
    with FileLock(os.path.join(data_dir, ".horovod_lock")):
        train_dataset = datasets.MNIST(
            data_dir, train=True, download=True, transform=datasets.normalize
        )
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    test_dataset = datasets.MNIST(data_dir, train=False, transform=datasets.normalize)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )
    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
        test()


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    train(args)
