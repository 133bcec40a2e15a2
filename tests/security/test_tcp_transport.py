"""The TCP transport (``transport="tcp"``, :mod:`ringtrain.transport.tcp_backend`) gives the
same results as Gloo: every collective, op and dtype, plain and sealed, and training.

At two ranks the ring sums in Gloo's order, so results are exact; at three, float sums may round
differently (the tolerance of :func:`test_sealed_collectives._compare`). These run outside the
enclave sandbox (fast, in the shared worlds); ``test_enclave_jobs.py`` runs real jobs inside it.
"""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.distributed as dist
from test_sealed_collectives import _collectives, _compare, _process_set, _uneven_all_gather
from test_sealed_ddp import _ddp
from test_secure_training import _train

from ringtrain.testing import spawn
from ringtrain.testing.spawn import World


@pytest.mark.parametrize("size", [2, 3])
def test_tcp_matches_gloo(size: int, key_file: str) -> None:
    world = spawn.world(size)
    gloo = world.run(_collectives, timeout=90, transport="gloo")
    tcp = world.run(_collectives, timeout=90, transport="tcp")
    _compare(gloo, tcp, exact=size == 2)
    sealed = world.run(_collectives, timeout=90, transport="tcp", secure=True, key_file=key_file)
    _compare(gloo, sealed, exact=size == 2)


def _backends() -> list[str]:
    from ringtrain.runtime import state

    comm = state.current().world.communicator
    groups = [dist.group.WORLD] + [comm.group(k) for k in ("control", "cpu", "engine")]
    return [str(dist.get_backend(g)) for g in groups]


def test_every_group_uses_the_chosen_transport(world2: World, key_file: str) -> None:
    assert world2.run(_backends, transport="tcp") == [["ringtrain_tcp"] * 4] * 2
    sealed = world2.run(_backends, transport="tcp", secure=True, key_file=key_file)
    assert sealed == [["ringtrain_sealed"] * 4] * 2
    # auto: netlink works here, so Gloo
    assert world2.run(_backends) == [["gloo"] * 4] * 2


def test_process_sets_and_uneven_gathers_on_tcp(world3: World) -> None:
    assert world3.run(_process_set, transport="tcp") == [[1.0, 1.0], [1.0, 1.0], []]
    for outs in world3.run(_uneven_all_gather, transport="tcp", timeout=60):
        assert [t.numel() for t in outs] == [300_000, 1000, 1000]
        assert all(torch.equal(t, torch.full_like(t, float(i))) for i, t in enumerate(outs))


@pytest.mark.parametrize("size", [2, 3])
def test_training_on_tcp_matches_gloo(size: int) -> None:
    world = spawn.world(size)
    gloo = world.run(_train, 6, timeout=120, transport="gloo")
    tcp = world.run(_train, 6, timeout=120, transport="tcp")
    for g, t in zip(gloo, tcp):
        for name in g:
            if size == 2:
                assert torch.equal(g[name], t[name]), name
            else:
                torch.testing.assert_close(g[name], t[name], rtol=1e-5, atol=1e-6, msg=name)


def test_plain_ddp_on_ringtrain_tcp_matches_gloo(world2: World) -> None:
    gloo = world2.run(_ddp, "gloo", uuid.uuid4().hex, 5, init=False)
    tcp = world2.run(_ddp, "ringtrain_tcp", uuid.uuid4().hex, 5, init=False, timeout=60)
    for g, t in zip(gloo, tcp):
        for name in g:
            assert torch.equal(g[name], t[name]), name
