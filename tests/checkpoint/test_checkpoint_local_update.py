"""A local-update optimizer (``sync_every``) in ringtrain.checkpoint.

Saved at 2 ranks mid-round (each rank's weights, inner Adam state, int8 error feedback and buffers
its own), at an outer-step boundary, overlapped (an exchange in flight: sent one step before the
save, applied one step after it), in 3 fragments with two exchanges in flight, and before the
first outer step from other weights on each rank (each rank's anchor its own): loaded into fresh
objects and trained on, every rank ends bitwise where the run that never stopped ends. Loaded at
1 and 3 ranks: every rank starts from the anchor and the outer optimizer's state, takes saved
rank ``r mod 2``'s inner state, the rest is reset and a log line says so; at 3 the ranks agree
after the next outer step. Sealed (secure mode): the same, with no plaintext weights on disk.
A checkpoint without local updates starts a local-update optimizer afresh from its weights.
``hvd.elastic.TorchState`` saves and loads it too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _local_job import Net
from _local_job import train as _train

import ringtrain as rt
import ringtrain.checkpoint as ckpt
import ringtrain.torch as hvd
from ringtrain.security import keys
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(600)
H = 3  # sync_every
TOTAL = 11


def _make(seed: int, overlap: int = 0, codec: str = "int8", fragments: int = 1) -> tuple[Net, Any]:
    """``overlap``: 0 off, else the overlapped exchange's ``outer_delay``."""
    model = Net(seed)
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every=H,
        outer_compression=codec,
        outer_overlap=overlap > 0,
        outer_delay=overlap,
        outer_fragments=fragments,
    )
    return model, opt


def _weights(model: Net) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _inner(opt: Any) -> dict[int, dict[str, Any]]:
    return {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        for i, st in opt.optimizer.state_dict()["state"].items()
    }


def _save_and_go_on(
    path: str, k: int, overlap: int, codec: str, spread: int = 0, fragments: int = 1
) -> dict[str, Any]:
    """The run that never stops: k steps, a save, the rest. ``spread``: the ranks start from
    other weights (until the first outer step each rank's anchor is its own)."""
    model, opt = _make(3 + spread * rt.rank(), overlap, codec, fragments)
    _train(model, opt, range(k))
    lu = opt.local_update
    ckpt.save(path, model=model, optimizer=opt, step=k)
    saved = {
        "weights": _weights(model),
        "anchor": [a.clone() for a in lu.anchor],
        "agreed": lu.agreed,
        "outer": [s["momentum_buffer"].clone() for s in lu.outer.state_dict()["state"].values()],
        "outer_steps": lu.outer_steps,
        "inner": _inner(opt),
        "in_flight": sum(f.pending is not None for f in lu.fragments),
    }
    _train(model, opt, range(k, TOTAL))
    return {"saved": saved, "final": _weights(model)}


def _load_and_go_on(
    path: str, k: int, overlap: int, codec: str, spread: int = 0, fragments: int = 1
) -> dict[str, Any]:
    model, opt = _make(99, overlap, codec, fragments)  # other weights: the load must replace them
    restored = ckpt.load(path, model=model, optimizer=opt)
    assert restored.step == k and restored.saved_world_size == 2
    loaded = _weights(model)
    _train(model, opt, range(k, TOTAL))
    return {"loaded": loaded, "final": _weights(model)}


def _other_fragments(path: str) -> str:
    model, opt = _make(99, 2, "int4", 1)
    try:
        ckpt.load(path, model=model, optimizer=opt)
    except Exception as e:  # the checkpoint's error type
        return f"{type(e).__name__}: {e}"
    return ""


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str) -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        assert torch.equal(a[key], b[key]), f"{where}: {key} differs"


@pytest.mark.parametrize(
    ("k", "overlap", "codec", "spread", "fragments"),
    [
        (7, 0, "int8", 0, 1),
        (6, 0, "int8", 0, 1),
        (7, 2, "fp16", 0, 1),
        (2, 1, "int4", 1, 1),
        (7, 2, "int4", 0, 3),
    ],
    ids=[
        "mid-round",
        "boundary",
        "overlapped-in-flight",
        "overlapped-before-the-first-outer-step",
        "fragments-two-in-flight",
    ],
)
def test_resume_at_the_same_size_is_bit_exact(
    tmp_path: Path,
    world2: spawn.World,
    k: int,
    overlap: int,
    codec: str,
    spread: int,
    fragments: int,
) -> None:
    path = str(tmp_path / f"step-{k}")
    want = world2.run(_save_and_go_on, path, k, overlap, codec, spread, fragments)
    got = world2.run(_load_and_go_on, path, k, overlap, codec, spread, fragments)
    # 3 fragments, delay 2, saved at step 7: fragments 0 (sent at 7) and 2 (at 6) in flight.
    if fragments > 1:
        assert want[0]["saved"]["in_flight"] == 2
        for message in world2.run(_other_fragments, path):
            assert message.startswith("CheckpointError") and "outer_fragments=3" in message
    # Before the first outer step the ranks' anchors differ: each rank's own is saved.
    assert want[0]["saved"]["agreed"] == (k >= H)
    if spread:
        assert not torch.equal(want[0]["saved"]["anchor"][0], want[1]["saved"]["anchor"][0])
    for r in range(2):
        _same(want[r]["saved"]["weights"], got[r]["loaded"], f"rank {r} as loaded")
        _same(want[r]["final"], got[r]["final"], f"rank {r} at the end")
    ranks_differ = not torch.equal(
        want[0]["saved"]["weights"]["a.weight"], want[1]["saved"]["weights"]["a.weight"]
    )
    assert ranks_differ == (overlap > 0 or k % H != 0)  # mid-round each rank holds its own weights
    assert not torch.equal(want[0]["saved"]["weights"]["seen"], want[1]["saved"]["weights"]["seen"])


# ---- another world size ------------------------------------------------------------------------


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _load_elsewhere(path: str) -> dict[str, Any]:
    model, opt = _make(99)
    lines = _Lines()
    logging.getLogger("ringtrain").addHandler(lines)
    try:
        ckpt.load(path, model=model, optimizer=opt)
    finally:
        logging.getLogger("ringtrain").removeHandler(lines)
    lu = opt.local_update
    got: dict[str, Any] = {
        "weights": [p.detach().clone() for p in model.parameters()],
        "inner": _inner(opt),
        "lines": lines.lines,
        "local": lu is not None,
    }
    if lu is not None:
        got["outer"] = [
            s["momentum_buffer"].clone() for s in lu.outer.state_dict()["state"].values()
        ]
        got["position"] = (lu.inner_steps, lu.outer_steps, [f.codec.residual for f in lu.fragments])
        _train(model, opt, range(7, 7 + H))  # one round: the next outer step
        got["after_round"] = [p.detach().clone() for p in model.parameters()]
    return got


@pytest.mark.parametrize("size", [1, 3])
def test_load_at_another_size_resumes_from_the_anchor(
    tmp_path: Path, world2: spawn.World, size: int
) -> None:
    path = str(tmp_path / "step-7")
    before = [b["saved"] for b in world2.run(_save_and_go_on, path, 7, 0, "int8")]
    after = spawn.world(size).run(_load_elsewhere, path, timeout=300)
    for r, got in enumerate(after):
        for a, w in zip(before[0]["anchor"], got["weights"]):
            assert torch.equal(a, w), f"rank {r}: not the anchor"
        source = r % 2 if size > 1 else 0
        for i, st in before[source]["inner"].items():
            for key, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(got["inner"][i][key]))
        assert got["local"] == (size > 1)  # at 1 rank a DistributedOptimizer has no local step
        if size > 1:
            for a, b in zip(before[0]["outer"], got["outer"]):
                assert torch.equal(a, b), f"rank {r}: outer momentum"
            assert got["position"] == (0, before[0]["outer_steps"], [None])
        message = got["lines"]
        if r != 0:
            assert message == []
            continue
        assert len(message) == 1, message
        assert "saved with local updates (sync_every=3) at 2 ranks" in message[0]
        assert f"outer step {before[0]['outer_steps']}" in message[0]
        if size == 1:
            assert "without local updates" in message[0]
        else:
            assert "reset:" in message[0] and "r mod 2's inner optimizer state" in message[0]
    # torch's tools read the checkpoint's model as the anchor, and each rank's own weights.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert torch.equal(whole["model"]["a.weight"], before[0]["anchor"][0])
    for r in range(2):
        assert torch.equal(whole[f"rank{r}"]["local.param.0"], before[r]["weights"]["a.weight"])
    if size > 1:  # after the next outer step every rank holds the same weights again
        for got in after[1:]:
            for a, b in zip(after[0]["after_round"], got["after_round"]):
                assert torch.equal(a, b)
        spawn.close(size)


# ---- sealed ----------------------------------------------------------------------------------


def _sealed_save(path: str, k: int) -> dict[str, Any]:
    out = _save_and_go_on(path, k, 0, "int8")
    needles = [
        out["saved"]["weights"]["a.weight"].numpy().tobytes()[:64],  # this rank's own weights
        out["saved"]["anchor"][0].numpy().tobytes()[:64],
        out["saved"]["inner"][0]["exp_avg_sq"].numpy().tobytes()[:64],
    ]
    return {**out, "needles": needles}


def test_sealed_mid_round_resume(tmp_path: Path, world2: spawn.World) -> None:
    key_file = keys.write_key_file(tmp_path / "key", keys.generate_job_key())
    secure = {"secure": True, "key_file": key_file}
    path = str(tmp_path / "step-5")
    want = world2.run(_sealed_save, path, 5, timeout=300, **secure)
    blobs = [Path(path, n).read_bytes() for n in os.listdir(path)]
    for r in range(2):
        for needle in want[r]["needles"]:
            assert not any(needle in b for b in blobs), f"rank {r}: plaintext on disk"
    got = world2.run(_load_and_go_on, path, 5, 0, "int8", timeout=300, **secure)
    for r in range(2):
        _same(want[r]["saved"]["weights"], got[r]["loaded"], f"rank {r} as loaded")
        _same(want[r]["final"], got[r]["final"], f"rank {r} at the end")


# ---- elastic TorchState ------------------------------------------------------------------------


def _torch_state(seed: int) -> Any:
    model, opt = _make(seed)
    return hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)


def _state_save(path: str) -> dict[str, Any]:
    state = _torch_state(3)
    _train(state.model, state.optimizer, range(4))
    state.batch = 4
    state.commit()
    state.save_checkpoint(path, step=4)
    at_save = _weights(state.model)
    _train(state.model, state.optimizer, range(4, TOTAL))
    return {"saved": at_save, "final": _weights(state.model)}


def _state_load(path: str) -> dict[str, Any]:
    state = _torch_state(99)
    state.load_checkpoint(path)
    _train(state.model, state.optimizer, range(4, 6))
    state.restore()  # back to what load_checkpoint committed: the loaded state, per rank
    loaded = _weights(state.model)
    _train(state.model, state.optimizer, range(state.batch, TOTAL))
    return {"loaded": loaded, "final": _weights(state.model)}


def test_torch_state_saves_and_loads_local_updates(tmp_path: Path, world2: spawn.World) -> None:
    path = str(tmp_path / "step-4")
    want = world2.run(_state_save, path)
    got = world2.run(_state_load, path)
    for r in range(2):
        _same(want[r]["saved"], got[r]["loaded"], f"rank {r} as loaded")
        _same(want[r]["final"], got[r]["final"], f"rank {r} at the end")


def _plain_into_local(path: str) -> dict[str, Any]:
    """Saved by a plain DistributedOptimizer, loaded into a local-update one that has trained
    past an outer step (an anchor, outer momentum), then one step."""
    plain = Net(5)
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(plain.parameters(), lr=0.01), named_parameters=plain.named_parameters()
    )
    _train(plain, opt, range(2))
    ckpt.save(path, model=plain, optimizer=opt, step=2)
    model, local = _make(99)
    _train(model, local, range(H + 1))
    lu = local.local_update
    assert lu.anchor is not None and lu.outer.state_dict()["state"]
    ckpt.load(path, model=model, optimizer=local)
    loaded = [p.detach().clone() for p in model.parameters()]
    got: dict[str, Any] = {
        "same": all(torch.equal(a, b) for a, b in zip(loaded, plain.parameters())),
        "afresh": (lu.anchor, lu.inner_steps, lu.outer.state_dict()["state"]) == (None, 0, {}),
    }
    _train(model, local, range(2, 3))
    got["anchor"] = all(torch.equal(a, b) for a, b in zip(lu.anchor, loaded))
    return got


def test_a_checkpoint_without_local_updates_starts_them_afresh(
    tmp_path: Path, world2: spawn.World
) -> None:
    got = world2.run(_plain_into_local, str(tmp_path / "step-2"))
    assert all(g == {"same": True, "afresh": True, "anchor": True} for g in got), got


# ---- files written before fragments ------------------------------------------------------------


def test_files_written_before_fragments_give_the_whole_model_state() -> None:
    """A file written before ``outer_fragments`` keeps one error feedback (``local.residual``),
    one average in flight (``local.pending``) and a flag for the weights as sent: the loader
    hands them on as the whole model's state (version 2), which LocalUpdate cuts into its
    fragments (tests/engine/test_local_update_fragments.py resumes such a state bitwise)."""
    from ringtrain.checkpoint import local_state

    residual, pending = torch.arange(5.0), torch.ones(5)
    base = [torch.zeros(2), torch.zeros(3)]
    tensors = {
        "rank1.local.residual": residual,
        "local.pending": pending,
        **{f"rank1.local.ref.{i}": b for i, b in enumerate(base)},
    }
    own = {"codec": "int4", "residual": True, "ref": True, "inner_steps": 1}
    got = local_state._in_flight(tensors, own, {"sync_every": 3}, 1, 2)
    assert got["codec"] == {"name": "int4", "residual": residual}
    assert got["overlap"]["pending"] is pending and got["overlap"]["since_sent"] == 1
    assert got["overlap"]["base"] == base
    own = {"codec": "fp16", "residual": False, "base": False, "since_sent": 2, "inner_steps": 2}
    got = local_state._in_flight({}, own, {"sync_every": 3}, 0, 2)
    assert got["codec"]["residual"] is None and got["overlap"]["base"] is None
    assert got["overlap"]["pending"] is None and got["overlap"]["since_sent"] == 2
