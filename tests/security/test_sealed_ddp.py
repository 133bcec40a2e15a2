"""Plain torch DDP on the ``ringtrain_sealed`` backend trains to the same weights as on Gloo."""

from __future__ import annotations

import datetime
import gc
import os
import uuid

import torch
import torch.nn.functional as F

from ringtrain.testing.spawn import World


def _train(steps: int) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = int(os.environ["RINGTRAIN_RANK"])
    torch.manual_seed(r)  # DDP broadcasts rank 0's weights at construction
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)),
        bucket_cap_mb=0.001,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + r)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _ddp(backend: str, tag: str, steps: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from ringtrain.transport import sealed_backend

    r, n = int(os.environ["RINGTRAIN_RANK"]), int(os.environ["RINGTRAIN_SIZE"])
    client = dist.TCPStore(
        "127.0.0.1",
        int(os.environ["RINGTRAIN_RENDEZVOUS_PORT"]),
        None,
        False,
        timeout=datetime.timedelta(seconds=30),
    )
    sealed_backend.register()
    dist.init_process_group(
        backend, store=dist.PrefixStore(f"ddp/{tag}", client), rank=r, world_size=n
    )
    try:
        # The DDP model is gone before the group is destroyed. Torch deadlocks otherwise: DDP's
        # reducer would drop the group's last reference with the GIL held, and the group's
        # destructor joins Gloo threads that need the GIL to free their last work.
        return _train(steps)
    finally:
        gc.collect()
        dist.destroy_process_group()
        sealed_backend.deconfigure()


def test_ddp_on_the_sealed_backend_matches_gloo(world2: World, key_file: str) -> None:
    plain = world2.run(_ddp, "gloo", uuid.uuid4().hex, 5, init=False)
    sealed = world2.run(
        _ddp,
        "ringtrain_sealed",
        uuid.uuid4().hex,
        5,
        init=False,
        env={"RINGTRAIN_KEY_FILE": key_file},
        timeout=60,
    )
    for p, s in zip(plain, sealed):
        for name in p:
            assert torch.equal(p[name], s[name]), name
    assert all(torch.equal(sealed[0][k], sealed[1][k]) for k in sealed[0])
