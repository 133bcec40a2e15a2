"""A rank of the deploy tests' jobs: a few SGD steps of a tiny model on data derived from the
rank and step, then a report (weights, placement, threads, memory) in ``--out/rank<R>.json``.
The test recomputes the same steps in one process and compares."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import ringtrain
import ringtrain.torch as hvd
from ringtrain.runtime import environment
from ringtrain.transport import tcp_backend


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x @ torch.arange(1.0, 9.0).unsqueeze(1)


def _mapped_objects_bytes() -> int:
    """Bytes of the shared objects this process maps (an enclave holds them whole)."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and ".so" in parts[5]:
                paths.add(parts[5])
    return sum(os.path.getsize(p) for p in paths if os.path.exists(p))


def _dev_shm_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_blocks * st.f_frsize


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    placement = environment.detect(os.environ)
    hvd.init()
    net = model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(net.parameters(), lr=0.01), named_parameters=net.named_parameters()
    )
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    for step in range(args.steps):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    report = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "launcher": placement.launcher,
        "secure": ringtrain.Config.from_env().secure,
        "backend": str(torch.distributed.get_backend()),
        "transport": ringtrain.Config.from_env().transport,
        "netlink": tcp_backend.netlink_available(),
        "hostname": os.uname().nodename,
        "weights": torch.cat([q.detach().reshape(-1) for q in net.parameters()]).tolist(),
        "threads": len(os.listdir("/proc/self/task")),
        "omp_threads": torch.get_num_threads(),
        "dev_shm_bytes": _dev_shm_bytes(),
        "vm_hwm_bytes": _vm_hwm_bytes(),
        "mapped_objects_bytes": _mapped_objects_bytes(),
    }
    hvd.shutdown()
    Path(args.out, f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
