"""Plain torch DDP on the ``ringtrain_sealed`` backend trains to the same weights as on Gloo; with
a wrong key, plain ``init_process_group`` fails at the first message on both ranks."""

from __future__ import annotations

import datetime
import gc
import os
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ringtrain.security import keys
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


def _plain_group(backend: str, tag: str, **kw: Any) -> None:
    """``init_process_group`` as a plain torch script calls it (no ringtrain.init), on the
    test world's store."""
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
        backend, store=dist.PrefixStore(f"ddp/{tag}", client), rank=r, world_size=n, **kw
    )


def _ddp(backend: str, tag: str, steps: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from ringtrain.transport import sealed_backend

    _plain_group(backend, tag)
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


def _allreduce_error(tag: str) -> str:
    """Plain ``init_process_group`` on the sealed backend (no ringtrain.init, so no authenticated
    rendezvous), then one allreduce: the error it raised, as ``Type: message``."""
    import torch.distributed as dist

    from ringtrain.transport import sealed_backend

    _plain_group("ringtrain_sealed", tag, timeout=datetime.timedelta(seconds=20))
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()
        sealed_backend.deconfigure()
    return "no error"


def test_plain_init_with_a_wrong_key_fails_at_the_first_message(
    world2: World, key_file: str, tmp_path: Path
) -> None:
    """docs/security.md: without ringtrain.init there is no authenticated rendezvous, and a
    wrong key still fails at the first message, on both ranks, instead of hanging."""
    other = keys.write_key_file(tmp_path / "other.key", keys.generate_job_key())
    envs = [{"RINGTRAIN_KEY_FILE": key_file}, {"RINGTRAIN_KEY_FILE": other}]
    errors = world2.run(_allreduce_error, uuid.uuid4().hex, init=False, env=envs, timeout=90)
    for r, error in enumerate(errors):
        assert error.startswith("SecurityError: "), (r, error)
        assert f"message from rank {1 - r} (host" in error and "another key" in error, error
