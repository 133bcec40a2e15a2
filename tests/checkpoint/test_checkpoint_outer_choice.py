"""A local-update job whose outer exchange ringtrain chose, through ringtrain.checkpoint.

A bare ``sync_every=H`` and ``sync_every="auto"`` choose the outer exchange themselves (int4,
overlapped, on a link the probe reads as slow). ``ckpt.load`` at the saved size takes that
choice, as ``load_state_dict`` does: into a fresh optimizer whose defaults would choose
otherwise now, without refusing the saved codec and without measuring again, and training on
ends bitwise where the run that never stopped ends. An outer codec the user gave that differs
from the saved one is still refused, with a hint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _local_job import Net
from _local_job import train as _train

import ringtrain as rt
import ringtrain.checkpoint as ckpt
from ringtrain.engine import auto, local_first
from ringtrain.engine.local_policy import OuterSettings
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(300)
SLOW = (0.002, 10e6 / 8 * 0.9)  # the probe's (latency s, bytes/s): 10 Mbit/s
FAST = (1e-5, 10e9 / 8)
CHOSEN = OuterSettings("int4", True, 2, "fixed by the test")


@contextlib.contextmanager
def _link(figures: tuple[float, float], auto_every: int | None = None) -> Iterator[None]:
    """The probe reads ``figures``; ``auto_every``: sync_every="auto" chooses that H with
    :data:`CHOSEN`'s exchange (0: synchronous). Restored after: the world is shared."""
    saved = auto.probe_link, auto.choose_sync_every, auto.outer_for
    auto.probe_link = lambda group, nbytes: figures  # type: ignore[assignment]
    if auto_every is not None:
        auto.choose_sync_every = lambda m, p, g=None: (auto_every, "fixed by the test")  # type: ignore[assignment]
        auto.outer_for = lambda m, e, g: CHOSEN  # type: ignore[assignment]
    try:
        yield
    finally:
        auto.probe_link, auto.choose_sync_every, auto.outer_for = saved


def _job(sync_every: int | str, seed: int, **settings: Any) -> tuple[Net, Any]:
    model = Net(seed)
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every=sync_every,
        **settings,
    )
    return model, opt


def _outer(opt: Any) -> tuple[str, bool, int]:
    lu = opt.local_update
    return (lu.codec_name, lu.overlap, lu.delay) if lu is not None else ("", False, 0)


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _resume(root: str, sync_every: int | str, save_at: int, total: int) -> dict[str, Any]:
    """Run ``total`` steps with a save at ``save_at`` (the probe slow), then load into a fresh
    job whose probe now reads a fast link and train to ``total`` again."""
    every = 3 if sync_every == "auto" else None
    with _link(SLOW, every):
        model, opt = _job(sync_every, seed=3)
        _train(model, opt, range(save_at))
        chosen = _outer(opt)
        why = opt.local_update.outer_reason
        path = ckpt.save(f"{root}/job", model=model, optimizer=opt, step=save_at)
        _train(model, opt, range(save_at, total))
        final = _weights(model)
    with _link(FAST, 0 if every is not None else None):
        model, opt = _job(sync_every, seed=99)  # other weights: the load must replace them
        ckpt.load(path, model=model, optimizer=opt)
        loaded = _outer(opt)
        loaded_why = opt.local_update.outer_reason
        _train(model, opt, range(save_at, total))
    again = _weights(model)
    return {
        "chosen": chosen,
        "loaded": loaded,
        "why": (why, loaded_why),
        "same": all(torch.equal(a, b) for a, b in zip(final, again)),
    }


@pytest.mark.parametrize(
    ("sync_every", "save_at", "total"),
    [(3, 7, 11), ("auto", local_first.START_H + 4, local_first.START_H + 10)],
    ids=["bare", "auto"],
)
def test_the_chosen_exchange_resumes_bit_exact(
    tmp_path: Path, world2: spawn.World, sync_every: int | str, save_at: int, total: int
) -> None:
    for r in world2.run(_resume, str(tmp_path), sync_every, save_at, total, timeout=240):
        assert r["chosen"][:2] == ("int4", True), r  # what the slow link chose
        assert r["loaded"] == r["chosen"], r  # taken from the file, not measured again
        assert r["why"][1] == r["why"][0], r
        assert r["same"], r


def _given_other_codec(root: str) -> tuple[str, str, str]:
    with _link(SLOW):
        model, opt = _job(3, seed=3)
        _train(model, opt, range(4))
        # What the slow link chose: int4, or fp16 where load made the step's compute slow too.
        chosen = _outer(opt)[0]
        path = ckpt.save(f"{root}/given", model=model, optimizer=opt, step=4)
        given = "int8" if chosen != "int8" else "fp16"
        model, opt = _job(3, seed=3, outer_compression=given)
    try:
        ckpt.load(path, model=model, optimizer=opt)
    except Exception as e:  # the checkpoint's error type
        return chosen, given, f"{type(e).__name__}: {e}"
    return chosen, given, ""


def test_a_given_codec_that_differs_is_refused(tmp_path: Path, world2: spawn.World) -> None:
    for chosen, given, msg in world2.run(_given_other_codec, str(tmp_path), timeout=240):
        assert chosen and chosen != "none", (chosen, msg)  # a codec was chosen for the link
        assert "CheckpointError" in msg and f"'{chosen}'" in msg and f"'{given}'" in msg, msg
        assert "HINT" in msg, msg
