"""Local updates in fragments (``outer_fragments=P``, streaming DiLoCo; issue 28).

Tiny's four parameters (72, 12, 36 and 3 values), ``sync_every=3``, 3 fragments: ``a.weight``,
``a.bias``, then ``b.weight`` with ``b.bias``; fragment ``f`` is exchanged at inner step ``f+1``
of each round. Shown at 2 ranks:

* the cut: consecutive parameters, about equal in values, at least one each, and the step of
  the round each is exchanged at;
* synchronous: at its step a fragment's weights are the mean of the ranks' (outer SGD lr 1, no
  momentum, no compression), the same on every rank, and the other fragments keep each rank's
  own weights (plain SGD inside; the gaps are float rounding);
* overlapped with a delay of 2 (so two fragments' exchanges are in flight at once): where a
  fragment's average is applied its anchor is the mean of the weights as sent, and each rank's
  weights are that plus its own inner steps since; the anchor's bits do not depend on timing;
* ``state_dict()`` resumes a run with two exchanges in flight and int4 error feedback to the
  same bits; a state written before fragments (the whole model in flight) loads into 3
  fragments and its average is applied where it was due, to the bits the whole-model run gets;
* a re-forming with exchanges in flight gives them up on every rank, and the ranks agree again;
* on Gloo, sealed (``secure=True``) and ``transport="tcp"`` the anchor is the same bits;
* a state taken, or loaded, while an exchange travels holds the error feedback it should;
* settings: ``RINGTRAIN_OUTER_FRAGMENTS``, and a clear error for more fragments than the
  round's steps or the model's parameters, or fragments without local updates.
"""

from __future__ import annotations

import concurrent.futures
import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _local import H, _adam_local, _alike, _sgd_local, _step, _weights
from test_local_update import _overlapped, _rejoin_overlapped, _transports

import ringtrain as rt
from ringtrain.config import Config
from ringtrain.engine import local_settings, outer_fragment
from ringtrain.errors import ConfigError
from ringtrain.runtime import abort
from ringtrain.testing import spawn

P = 3


def _slices(local: Any) -> list[slice]:
    """Each fragment's values in the flat vector of the model's weights."""
    out, offset = [], 0
    for frag in local.fragments:
        out.append(slice(offset, offset + frag.numel))
        offset += frag.numel
    return out


def _arithmetic(overlap: bool) -> list[float]:
    """Plain SGD inside, outer SGD lr 1 without momentum, no compression, 3 fragments. The gaps
    (float rounding only) between what each fragment holds and what it should."""
    model, inner, opt = _sgd_local(
        outer_overlap=overlap, outer_delay=2 if overlap else 0, outer_fragments=P
    )
    local = opt.local_update
    assert local is not None and [f.end for f in local.fragments] == [1, 2, 3]
    parts = _slices(local)
    gaps: list[float] = []
    sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # fragment: (as sent, the mean)
    for i in range(1, 4 * H + 1):
        _step(model, opt, i)
        now, after = _weights(model), inner.after
        due = (i - 1) % H  # the fragment exchanged at this step
        part = parts[due]
        mean = rt.allgather(after.reshape(1, -1)).mean(0)
        anchor = torch.cat([a.reshape(-1) for a in local.anchor or []])
        if not overlap:
            gaps.append(float((now[part] - mean[part]).abs().max()))
            assert _alike(now[part])
            for other in set(range(P)) - {due}:  # each rank's own
                gaps.append(float((now[parts[other]] - after[parts[other]]).abs().max()))
            continue
        merging = (i - 3) % H if i > 2 else None  # sent two steps ago: applied now
        if merging is not None and merging in sent:
            was, avg = sent.pop(merging)
            m = parts[merging]
            gaps.append(float((anchor[m] - avg[m]).abs().max()))
            gaps.append(float((now[m] - (avg[m] + after[m] - was[m])).abs().max()))
        sent[due] = (after.clone(), mean)  # sent now: the weights go on unchanged
        gaps.append(float((now[part] - after[part]).abs().max()))
    if overlap:
        assert len(sent) == 2  # the last two fragments' exchanges are still in flight
    return gaps


@pytest.mark.timeout(300)
def test_each_fragment_is_averaged_at_its_own_step() -> None:
    world = spawn.world(2)
    for overlap in (False, True):
        for gaps in world.run(_arithmetic, overlap, timeout=240):
            assert len(gaps) > 12 and max(gaps) < 1e-6, (overlap, gaps)
    quick = world.run(_overlapped, 0.0, 2, P, timeout=240)
    slowed = world.run(_overlapped, 0.02, 2, P, timeout=240)
    for r in quick + slowed:
        assert not all(r["weights"])  # each rank keeps its own inner steps on top
    assert torch.equal(quick[0]["anchor"], slowed[0]["anchor"])  # timing changes no bit
    assert torch.equal(quick[0]["anchor"], quick[1]["anchor"])
    assert torch.equal(slowed[0]["anchor"], slowed[1]["anchor"])


@pytest.mark.timeout(300)
def test_fragments_on_every_transport_give_the_same_bits(tmp_path: Path) -> None:
    """Overlapped, 3 fragments, int8 (each rank sums the ranks' pieces in rank order): the
    anchor is the same on every rank and the same bits on Gloo, sealed and tcp."""
    world = spawn.world(2)
    anchors = {}
    for name, settings in _transports(tmp_path).items():
        results = world.run(_overlapped, 0.0, 2, P, timeout=240, **settings)
        assert all(results[0]["anchors"]) and torch.equal(
            results[0]["anchor"], results[1]["anchor"]
        )
        anchors[name] = results[0]["anchor"]
    assert torch.equal(anchors["gloo"], anchors["secure"]), "sealed"
    assert torch.equal(anchors["gloo"], anchors["tcp"]), "tcp"


def _resume(from_whole: bool) -> bool:
    """Saved at step 2H+2 (fragments 1 and 2 in flight, int4 error feedback), resumed in a fresh
    model and optimizer: the bits of the run that never stopped. ``from_whole``: the state is
    written by a whole-model run (one fragment, its exchange in flight) and rewritten as
    ringtrain wrote it before fragments (version 2); loaded into 3 fragments, the average in
    flight is applied at the step it was due, to the whole-model run's anchor."""
    saving = 1 if from_whole else P

    def make(fragments: int) -> tuple[torch.nn.Module, Any]:
        return _adam_local(
            outer_compression="int4",
            outer_overlap=True,
            outer_delay=2,
            outer_fragments=fragments,
        )

    model, opt = make(saving)
    cut = 2 * H + (1 if from_whole else 2)
    for i in range(cut):
        _step(model, opt, i)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    for i in range(cut, cut + 1 if from_whole else 4 * H):
        _step(model, opt, i)
    straight = _weights(model)
    straight_anchor = [a.clone() for a in opt.local_update.anchor]
    opt.state_dict()  # waits for the exchanges still in flight: the next optimizer's wire is free

    model, opt = make(P)
    _step(model, opt, 0)  # a different history, overwritten by the load
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    state = saved["opt"]["ringtrain_local_update"]
    assert sum(m is not None for m in state["overlap"]["pending"]) == (1 if from_whole else 2)
    if from_whole:
        state["version"] = 2
        state["codec"]["residual"] = state["codec"]["residual"][0]
        state["overlap"]["pending"] = state["overlap"]["pending"][0]
        state["overlap"]["since_sent"] = state["overlap"]["since_sent"][0]
        del state["fragments"]
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for i in range(cut, cut + 1 if from_whole else 4 * H):
        _step(model, opt, i)
    if from_whole:  # applied at the step it was due (then fragment 1 was sent: no change)
        return all(torch.equal(a, b) for a, b in zip(straight_anchor, opt.local_update.anchor))
    return torch.equal(straight, _weights(model))


def _wrong_count() -> str:
    _, opt = _adam_local(outer_overlap=True, outer_fragments=P)
    _, other = _adam_local(outer_overlap=True, outer_fragments=2)
    try:
        other.load_state_dict(opt.state_dict())
    except ConfigError as e:
        return str(e)
    return ""


@pytest.mark.timeout(300)
def test_fragments_resume_to_the_same_bits() -> None:
    world = spawn.world(2)
    assert all(world.run(_resume, False, timeout=240))
    assert all(world.run(_resume, True, timeout=240))
    for message in world.run(_wrong_count, timeout=120):
        assert "outer_fragments=3" in message and "HINT" in message
    for taken, kept in world.run(_state_while_in_flight, timeout=120):
        assert taken and kept


def _state_while_in_flight() -> tuple[bool, bool]:
    """An exchange in flight sets its error feedback as it runs (here: after 0.3 s). The state
    taken while it travels holds that error feedback, not the one before it; a state loaded
    while it travels is not overwritten by it as it ends (the GPU machine showed both races:
    a rank resumed with a stale error feedback)."""
    _, opt = _adam_local(outer_compression="int4", outer_overlap=True, outer_delay=2)
    local = opt.local_update
    codec = local.fragments[0].codec
    average = codec.average

    def slow(flat: torch.Tensor) -> torch.Tensor:
        time.sleep(0.3)
        return average(flat)

    codec.average = slow
    model = opt.optimizer.param_groups[0]["params"]

    def steps(first: int, count: int) -> None:
        for i in range(first, first + count):
            for p in model:
                p.grad = torch.full_like(p, 0.1 * (rt.rank() + 1) + 0.01 * i)
            opt.step()

    steps(0, H - 1)
    before = local.local_state_dict()  # nothing sent yet: no error feedback
    steps(H - 1, 1)  # the first exchange starts
    state = local.local_state_dict()
    saved = state["codec"]["residual"][0]
    taken = saved is not None and torch.equal(saved, codec.residual)
    steps(H, H)  # the next exchange starts; loaded while it travels:
    local.load_local_state_dict(before)
    time.sleep(0.5)
    return taken, codec.residual is None


@pytest.mark.timeout(300)
def test_rejoin_gives_up_every_fragment_in_flight() -> None:
    for in_flight, given_up, alike, copies in spawn.world(2).run(
        _rejoin_overlapped, P, timeout=240
    ):
        assert in_flight and given_up and alike
        assert copies == 1


# ---- units ---------------------------------------------------------------------------------------


def test_an_exchange_of_a_replaced_world_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore in an elastic job gives up the exchanges in flight. In the world the ranks
    still run in, it lets them end first; in one the launcher replaced, it does not wait: a
    survivor that left that world first may never send its part (a 240 s hang under stress-ng,
    waiting for the transport timeout), and that world's wire is closed at the rejoin."""
    frag = outer_fragment.Fragment(0, 0, 1, 1, 1, codec=None)  # type: ignore[arg-type]
    never: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
    monkeypatch.setattr(abort, "announced", lambda: 1)  # world 1 announced; this rank is in 0
    monkeypatch.setattr(abort, "generation", 0)
    frag.pending = never
    t0 = time.monotonic()
    frag.drop(settle=True)
    assert frag.pending is None and time.monotonic() - t0 < 10.0  # the future never ends
    # The current world's: let it end first.
    monkeypatch.setattr(abort, "announced", lambda: 0)
    ending: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
    frag.pending = ending
    threading.Timer(0.3, ending.set_result, (torch.zeros(1),)).start()
    frag.drop(settle=True)
    assert ending.done() and frag.pending is None


def test_the_cut_is_consecutive_balanced_and_staggered() -> None:
    params = [torch.zeros(n) for n in (72, 12, 36, 3)]
    wire: Any = None  # the codecs are not used here
    cut = outer_fragment.split(params, 3, 3, "fp16", wire)
    assert [(f.first, f.stop, f.numel, f.end) for f in cut] == [
        (0, 1, 72, 1),
        (1, 2, 12, 2),
        (2, 4, 39, 3),
    ]
    even = outer_fragment.split([torch.zeros(10)] * 8, 4, 16, "fp16", wire)
    assert [(f.first, f.stop, f.end) for f in even] == [
        (0, 2, 4),
        (2, 4, 8),
        (4, 6, 12),
        (6, 8, 16),
    ]
    one = outer_fragment.split(params, 1, 5, "fp16", wire)
    assert [(f.first, f.stop, f.end) for f in one] == [(0, 4, 5)]  # the whole model, at H
    # One huge parameter first: the others still get a fragment each.
    lopsided = outer_fragment.split([torch.zeros(n) for n in (1000, 1, 1)], 3, 3, "fp16", wire)
    assert [(f.first, f.stop) for f in lopsided] == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ConfigError, match="only 4 floating parameter"):
        outer_fragment.split(params, 5, 8, "fp16", wire)


def test_outer_fragments_settings() -> None:
    config = Config.from_env({"RINGTRAIN_OUTER_FRAGMENTS": "4", "RINGTRAIN_SYNC_EVERY": "16"})
    assert config.outer_fragments == 4
    local_settings.check(config)
    with pytest.raises(ConfigError, match="outer_fragments must be"):
        Config.from_env({"RINGTRAIN_OUTER_FRAGMENTS": "0"})
    with pytest.raises(ConfigError, match="more than the round's 8 inner steps"):
        local_settings.check(Config(sync_every="8", outer_fragments=9))
    with pytest.raises(ConfigError, match="sync_every is off"):
        local_settings.check(Config(outer_fragments=2))
