"""Peak memory per rank of the sharded optimizer step (ZeRO stage 1) against the unsharded engine,
as the allocator counts it: ``torch.cuda.max_memory_allocated`` on a GPU (what ZeRO's papers
report), the tensors the step holds otherwise. One mode per launch, so no mode's leftovers count
against the other. Run it under a launcher, once per mode::

    ringtrain run -np 4 -- python scripts/bench_zero_memory.py --shard 0 --json unsharded.json
    ringtrain run -np 4 -- python scripts/bench_zero_memory.py --shard 1 --json sharded.json

On a one-GPU machine every rank uses that GPU (its CUDA tensors then travel through host memory,
docs/engine.md "GPUs"): each rank's own allocations are still its own.
"""

from __future__ import annotations

import argparse
import json

import torch

import ringtrain.torch as hvd
from ringtrain.bench.models import count_parameters, get_preset

MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shard", type=int, choices=(0, 1), required=True)
    p.add_argument("--model", default="transformer-25m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="rank 0 writes every rank's figures here")
    args = p.parse_args()

    hvd.init()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset = get_preset(args.model)
    torch.manual_seed(0)
    model = preset.build().to(device)
    n_params = count_parameters(model)
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-4),
        named_parameters=model.named_parameters(),
        shard_optimizer=bool(args.shard),
        link_class="fast",  # the same bucket plan in both modes
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    g = torch.Generator().manual_seed(hvd.rank())
    losses = []
    for _ in range(args.steps):
        x, y = preset.make_batch(preset.default_batch_size, g)
        opt.zero_grad()
        loss = preset.loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if cuda:
        torch.cuda.synchronize(device)
    mine = {
        "rank": hvd.rank(),
        "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / MiB if cuda else None,
        "allocated_before_steps_mib": before / MiB,
        "allocated_after_mib": torch.cuda.memory_allocated(device) / MiB if cuda else None,
        "optimizer_state_mib": opt.state_bytes / MiB,
        "last_loss": losses[-1],
    }
    every = hvd.allgather_object(mine)
    if hvd.rank() == 0:
        out = {
            "model": args.model,
            "parameters": n_params,
            "ranks": hvd.size(),
            "mode": "sharded" if args.shard else "unsharded",
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__,
            "steps": args.steps,
            "per_rank": every,
        }
        peaks = [r["peak_allocated_mib"] for r in every]
        print(
            f"{out['mode']}: {args.model} ({n_params / 1e6:.1f}M parameters), {hvd.size()} ranks, "
            f"Adam, {args.steps} steps on {out['device']}; optimizer state/rank "
            f"{max(r['optimizer_state_mib'] for r in every):.1f} MiB; peak allocated/rank "
            + (
                f"{max(peaks):.1f} MiB (ranks: {', '.join(f'{x:.1f}' for x in peaks)})"
                if cuda
                else "n/a"
            )
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
