"""Local updates (``sync_every``, issue 28) and their checkpoints with the model on a GPU.

Skipped where CUDA is not available (CI has no GPU): run ``pytest tests/gpu`` on a GPU machine.
The outer exchange goes over the engine's Gloo group from host memory (the change is copied
there once a round), so it works alike whether the ranks share a GPU or not. At 2 ranks, for
each outer wire (none, fp16, int4) and with the exchange overlapped or not:

* the weights stay on the GPU, and every rank holds the same anchor after each outer step;
* ranks that start from other weights get rank 0's anchor at the first outer step (one copy,
  counted; the digest of CUDA tensors is taken through host memory);
* a checkpoint saved mid-round with an overlapped exchange in flight, loaded into a fresh model
  and optimizer on the GPU, ends every rank bitwise where the run that never stopped ends;
* each of these also with the parameters in 2 fragments (``outer_fragments=2``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _cuda import classifier, train

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.testing import spawn

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: torch.cuda.is_available() is False",
    ),
    pytest.mark.timeout(300),
]
H = 2


def _make(seed: int, codec: str, overlap: bool, fragments: int = 1) -> tuple[torch.nn.Module, Any]:
    model = classifier(seed)
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every=H,
        outer_compression=codec,
        outer_overlap=overlap,
        outer_delay=1 if overlap else 0,
        outer_fragments=fragments,
    )
    return model, opt


def _flat(ts: Any) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in ts])


def _alike(t: torch.Tensor) -> bool:
    every = rt.allgather(t.cpu().reshape(1, -1))
    return torch.equal(every, every[:1].expand_as(every))


def _rounds(codec: str, overlap: bool, fragments: int) -> dict[str, Any]:
    model, opt = _make(1 + rt.rank(), codec, overlap, fragments)  # other weights on each rank
    local = opt.local_update
    assert local is not None
    anchors = []
    for step in range(3 * H):
        train(model, opt, range(step, step + 1))
        if (step + 1) % H == 0:
            anchors.append(_alike(_flat(local.anchor)))
    on_gpu = all(p.is_cuda for p in model.parameters()) and all(a.is_cuda for a in local.anchor)
    finite = bool(torch.isfinite(_flat(model.parameters())).all())
    opt.remove_hooks()
    return {"anchors": anchors, "on_gpu": on_gpu, "finite": finite, "copies": local.copies}


@pytest.mark.parametrize("fragments", [1, 2], ids=["whole", "2-fragments"])
@pytest.mark.parametrize("overlap", [False, True], ids=["at-once", "overlapped"])
@pytest.mark.parametrize("codec", ["none", "fp16", "int4"])
def test_local_updates_agree_on_the_gpu(codec: str, overlap: bool, fragments: int) -> None:
    for r in spawn.world(2).run(_rounds, codec, overlap, fragments, timeout=240):
        assert r["on_gpu"] and r["finite"], r
        assert all(r["anchors"]), r
        assert r["copies"] == 1, r  # the first outer step copied rank 0's anchor, once


def _save_and_go_on(path: str, fragments: int) -> dict[str, torch.Tensor]:
    model, opt = _make(3, "int4", True, fragments)
    train(model, opt, range(H + 1))  # sent at H, applied at H + 1: then mid-round
    train(model, opt, range(H + 1, 2 * H))  # the next exchange is in flight at the save
    ckpt.save(path, model=model, optimizer=opt, step=2 * H)
    train(model, opt, range(2 * H, 4 * H + 1))
    return {"weights": _flat(model.parameters()).cpu()}


def _load_and_go_on(path: str, fragments: int) -> dict[str, torch.Tensor]:
    model, opt = _make(99, "int4", True, fragments)
    restored = ckpt.load(path, model=model, optimizer=opt)
    assert restored.step == 2 * H
    assert all(p.is_cuda for p in model.parameters())
    train(model, opt, range(2 * H, 4 * H + 1))
    return {"weights": _flat(model.parameters()).cpu()}


@pytest.mark.parametrize("fragments", [1, 2], ids=["whole", "2-fragments"])
def test_checkpoint_with_an_exchange_in_flight_resumes_bitwise(
    tmp_path: Path, fragments: int
) -> None:
    world = spawn.world(2)
    path = str(tmp_path / "ckpt")
    want = world.run(_save_and_go_on, path, fragments, timeout=240)
    got = world.run(_load_and_go_on, path, fragments, timeout=240)
    for r in range(2):
        assert torch.equal(want[r]["weights"], got[r]["weights"]), f"rank {r}"
