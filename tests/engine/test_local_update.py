"""The local-update step (``DistributedOptimizer(sync_every=H)``, DiLoCo; issue 28).

Shown at 2 ranks, on each transport (Gloo, sealed ``secure=True``, ``transport="tcp"``):

* every rank holds identical weights after every outer step, and differs between them (the
  inner steps really are local);
* ``sync_every=1`` with plain SGD inside and outer SGD at lr 1.0 without momentum is synchronous
  SGD on averaged gradients (the average of one-step changes is the step on the average);
* the outer exchange's wires (fp16, int8, int4) keep the ranks identical;
* ``state_dict()``/``load_state_dict()`` (anchor, outer optimizer, error feedback included)
  resume a run to the same bits;
* a re-formed world (``rejoin()``) with a rank whose anchor and outer state are another's (a
  rank that joined) holds identical weights again after the next outer step;
* the overlapped outer exchange (``outer_overlap=True``, its average applied ``outer_delay``
  inner steps after it was sent, one step to a whole round) keeps every rank's anchor
  identical, and its bits do not depend on timing (a rank slowed down at random gives the same
  anchor); it resumes from ``state_dict()`` to the same bits, the exchange in flight included;
  where applied, the anchor is the outer step on the weights as sent and each rank goes on
  from it plus its own inner steps since it sent;
* ranks that start alike send no copy of the weights at the first outer step (their digests
  agree); ranks that differ get rank 0's copy (one copy, counted).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from _local import H, Tiny, _adam_local, _alike, _sgd_local, _step, _weights

import ringtrain as rt
from ringtrain.config import OUTER_COMPRESSIONS, Config
from ringtrain.engine import local_settings, outer_codec
from ringtrain.engine.local_settings import outer_delay, parse_sync_every
from ringtrain.errors import ConfigError
from ringtrain.security import keys
from ringtrain.testing import spawn

ROUNDS = 3


def _rounds(codec: str) -> dict[str, Any]:
    """Adam inside, the default outer optimizer: identical after each outer step, not between."""
    model, opt = _adam_local(outer_compression=codec)
    after_outer, between = [], []
    for i in range(H * ROUNDS):
        _step(model, opt, i)
        alike = _alike(_weights(model))
        (after_outer if (i + 1) % H == 0 else between).append(alike)
    local = opt.local_update
    assert local is not None
    return {
        "after_outer": after_outer,
        "between": between,
        "outer_steps": local.outer_steps,
        "bytes": local.bytes_sent,
        "copies": local.copies,
        "weights": _weights(model),
    }


def _equals_synchronous_sgd() -> float:
    """sync_every=1, SGD inside, outer SGD lr 1 momentum 0: the gap to synchronous SGD."""
    runs = []
    for local in (True, False):
        torch.manual_seed(0)
        model = Tiny()
        extra: dict[str, Any] = {}
        if local:
            extra = {
                "sync_every": 1,
                "outer_compression": "none",
                "outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=1.0),
            }
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            **extra,
        )
        for i in range(4):
            _step(model, opt, i)
        if not local:
            opt.remove_hooks()
        runs.append(_weights(model))
    return float((runs[0] - runs[1]).abs().max())


def _overlapped(delay: float, outer_delay: int, fragments: int = 1) -> dict[str, Any]:
    """Overlapped outer exchange: the anchors after each outer step, with rank 1 sleeping up to
    ``delay`` s at random before its steps (another timing every call)."""
    import random
    import time

    model, opt = _adam_local(
        outer_compression="int8",
        outer_overlap=True,
        outer_delay=outer_delay,
        outer_fragments=fragments,
    )
    local = opt.local_update
    assert local is not None and local.overlap and local.delay == (outer_delay or 1)
    anchors_alike, weights_alike = [], []
    for i in range(H * (ROUNDS + 1)):
        if rt.rank() == 1 and delay:
            time.sleep(random.uniform(0, delay))
        _step(model, opt, i)
        if (i + 1) % H == 0:
            assert local.anchor is not None
            anchors_alike.append(_alike(torch.cat([a.reshape(-1) for a in local.anchor])))
            weights_alike.append(_alike(_weights(model)))
    with local.anchored():
        anchor = _weights(model)
    return {"anchors": anchors_alike, "weights": weights_alike, "anchor": anchor}


def _merge_arithmetic(path: str) -> tuple[list[float], dict[str, int], float]:
    """Plain SGD inside, outer SGD lr 1 without momentum, no compression, sync_every 3, delay
    2: where the average is applied the anchor is the mean of the weights as sent, and each
    rank's weights are that plus its own inner steps since (the gaps, float rounding only).
    Also: the timeline's OUTER_STEP and OUTER_MERGE spans, and the time counted in them."""
    from ringtrain.diagnostics import timeline

    model, inner, opt = _sgd_local(outer_overlap=True, outer_delay=2)
    local = opt.local_update
    assert local is not None
    gaps: list[float] = []
    sent = mean = torch.empty(0)
    rt.start_timeline(path)
    name = timeline.rank_path(path, rt.rank())
    for i in range(1, 3 * H + 1):
        _step(model, opt, i)
        if i % H == 0:  # sent: the weights go on unchanged
            sent = _weights(model)
            mean = rt.allgather(sent.reshape(1, -1)).mean(0)
            gaps.append(float((sent - inner.after).abs().max()))
        elif i % H == 2 and i > H:  # applied two inner steps after it was sent
            anchor = torch.cat([a.reshape(-1) for a in local.anchor or []])
            gaps.append(float((anchor - mean).abs().max()))
            gaps.append(float((_weights(model) - (mean + inner.after - sent)).abs().max()))
    rt.stop_timeline()
    assert len(gaps) == 3 + 2 * 2 and local.outer_steps == 3
    spans = [e["name"] for e in timeline.load(name) if e.get("ph") == "X"]
    counts = {k: spans.count(k) for k in ("OUTER_STEP", "OUTER_MERGE")}
    return gaps, counts, local.outer_seconds


def _resume(overlap: bool = False, v1: bool = False) -> bool:
    """A run saved mid-round and resumed in a fresh model and optimizer ends with the bits of
    the run that never stopped. ``v1``: overlapped a whole round late, the state rewritten as
    ringtrain wrote it before ``outer_delay`` (version 1, the weights as sent called "ref")."""

    def make() -> tuple[torch.nn.Module, Any]:
        late = {"outer_delay": H} if v1 else {}
        return _adam_local(outer_compression="int8", outer_overlap=overlap or v1, **late)

    model, opt = make()
    for i in range(2 * H + 1):
        _step(model, opt, i)
    # Through bytes, as a checkpoint file: a state_dict holds references to live tensors.
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    assert "ringtrain_local_update" in opt.state_dict()
    for i in range(2 * H + 1, 4 * H):
        _step(model, opt, i)
    straight = _weights(model)
    # Overlapped, the last step sent an exchange still on the wire: the next optimizer's first
    # collectives queue behind it on every rank (test_local_update_shared_group.py).

    model, opt = make()
    _step(model, opt, 0)  # a different history, overwritten by the load
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    if v1:
        state = saved["opt"]["ringtrain_local_update"]
        flight = state.pop("overlap")
        state["codec"]["residual"] = state["codec"]["residual"][0]  # one fragment: the model
        state["version"], state["overlap"] = (
            1,
            {"ref": flight["base"], "pending": flight["pending"][0]},
        )
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for i in range(2 * H + 1, 4 * H):
        _step(model, opt, i)
    return torch.equal(straight, _weights(model))


def _rejoin() -> tuple[bool, bool, int]:
    """Rank 1 plays a rank that joined between outer steps: other weights, another anchor and
    no outer state. After rejoin() and the next outer step every rank is identical."""
    model, opt = _adam_local()
    for i in range(H + 1):
        _step(model, opt, i)
    local = opt.local_update
    assert local is not None
    if rt.rank() == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        local.anchor = [p.detach().clone() for p in model.parameters()]
        local.outer.state.clear()
    before = _alike(_weights(model))
    opt.rejoin()
    for i in range(H):
        _step(model, opt, 100 + i)
    return before, _alike(_weights(model)), local.copies


def _transports(tmp_path: Path) -> dict[str, dict[str, Any]]:
    key_file = keys.write_key_file(tmp_path / "job.key", keys.generate_job_key())
    return {
        "gloo": {},
        "secure": {"secure": True, "key_file": key_file},
        "tcp": {"transport": "tcp"},
    }


@pytest.mark.timeout(600)
def test_local_updates_on_every_transport(tmp_path: Path) -> None:
    world = spawn.world(2)
    for name, settings in _transports(tmp_path).items():
        by_codec = {}
        for codec in ("fp16", "int8", "int4"):
            results = world.run(_rounds, codec, timeout=300, **settings)
            for r in results:
                assert all(r["after_outer"]), (name, codec, r["after_outer"])
                assert not any(r["between"]), (name, codec, "inner steps exchanged something")
                assert r["outer_steps"] == ROUNDS
                assert r["bytes"] > 0
                assert r["copies"] == 0  # one seed: the digests agreed, no copy was sent
            by_codec[codec] = results[0]
        # 4 bytes of scale per 128 values: int8 about half of fp16's bytes, int4 a quarter.
        assert by_codec["int8"]["bytes"] < 0.6 * by_codec["fp16"]["bytes"]
        assert by_codec["int4"]["bytes"] < 0.6 * by_codec["int8"]["bytes"]
        gaps = world.run(_equals_synchronous_sgd, timeout=300, **settings)
        assert max(gaps) <= 1e-6, (name, gaps)


@pytest.mark.timeout(300)
def test_state_dict_resumes_to_the_same_bits() -> None:
    world = spawn.world(2)
    assert all(world.run(_resume, timeout=240))
    assert all(world.run(_resume, False, True, timeout=240))  # a state from before the delay


@pytest.mark.timeout(300)
def test_overlapped_exchange_is_alike_everywhere_and_independent_of_timing() -> None:
    world = spawn.world(2)
    quick = world.run(_overlapped, 0.0, 0, timeout=240)
    slowed = world.run(_overlapped, 0.02, 0, timeout=240)
    for r in quick + slowed:
        assert all(r["anchors"])  # the anchor: the same bits on every rank
        assert not all(r["weights"])  # each rank keeps its own round's change on top
    assert torch.equal(quick[0]["anchor"], slowed[0]["anchor"])
    assert torch.equal(quick[0]["anchor"], quick[1]["anchor"])
    assert all(world.run(_resume, True, timeout=240))
    # A whole round late (applied as the next round's change is sent): the same properties.
    late = world.run(_overlapped, 0.0, H, timeout=240)
    assert all(late[0]["anchors"]) and torch.equal(late[0]["anchor"], late[1]["anchor"])
    assert not torch.equal(late[0]["anchor"], quick[0]["anchor"])


@pytest.mark.timeout(300)
def test_overlapped_merge_is_the_outer_step_plus_own_progress(tmp_path: Path) -> None:
    trace = str(tmp_path / "trace.json")
    for gaps, spans, seconds in spawn.world(2).run(_merge_arithmetic, trace, timeout=240):
        assert max(gaps) < 1e-6, gaps
        assert spans == {"OUTER_STEP": 3, "OUTER_MERGE": 2} and seconds > 0, (spans, seconds)


@pytest.mark.timeout(300)
def test_rejoined_world_is_identical_after_the_next_outer_step() -> None:
    for before, after, copies in spawn.world(2).run(_rejoin, timeout=240):
        assert not before
        assert after
        assert copies == 1  # the joined rank's digest differed: rank 0's anchor was copied


def _rejoin_overlapped(fragments: int = 1) -> tuple[bool, bool, bool, int]:
    """Overlapped: a re-forming while an exchange is in flight gives it up on every rank; the
    next round agrees the anchor (rank 1's differs, as a joined rank's) and applies its average
    on every rank alike."""
    model, opt = _adam_local(outer_overlap=True, outer_delay=2, outer_fragments=fragments)
    local = opt.local_update
    assert local is not None
    for i in range(H):
        _step(model, opt, i)
    in_flight = any(f.pending is not None for f in local.fragments)
    if rt.rank() == 1:
        local.anchor = [a + 1.0 for a in local.anchor or []]
    opt.rejoin()
    given_up = all(f.pending is None for f in local.fragments)
    for i in range(H + 2):  # a round, then the two steps until its average is applied
        _step(model, opt, 100 + i)
    anchor = torch.cat([a.reshape(-1) for a in local.anchor or []])
    return in_flight, given_up, _alike(anchor), local.copies


@pytest.mark.timeout(300)
def test_rejoin_gives_up_the_overlapped_exchange_in_flight() -> None:
    for in_flight, given_up, alike, copies in spawn.world(2).run(_rejoin_overlapped, timeout=240):
        assert in_flight and given_up and alike
        assert copies == 1


def _one_rank() -> bool:
    torch.manual_seed(0)
    a, b = Tiny(), Tiny()
    b.load_state_dict(a.state_dict())
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(a.parameters(), lr=0.1), a.named_parameters(), sync_every=2
    )
    plain = torch.optim.SGD(b.parameters(), lr=0.1)
    for i in range(3):
        _step(a, opt, i)
        _step(b, plain, i)
    return opt.local_update is None and torch.equal(_weights(a), _weights(b))


def _clashes() -> list[str]:
    out = []
    for extra in ({"shard_optimizer": True}, {"overlap": True}):
        model = Tiny()
        try:
            rt.DistributedOptimizer(
                torch.optim.Adam(model.parameters()),
                model.named_parameters(),
                sync_every=4,
                **extra,
            )
        except ConfigError as e:
            out.append(str(e))
    return out


@pytest.mark.timeout(180)
def test_sharding_and_overlap_are_refused_with_local_updates() -> None:
    for messages in spawn.world(2).run(_clashes, timeout=120):
        assert len(messages) == 2
        assert "shard_optimizer" in messages[0] and "overlap" in messages[1]
        assert all("HINT" in m for m in messages)


@pytest.mark.timeout(180)
def test_one_rank_trains_as_the_plain_optimizer() -> None:
    """Nothing to exchange at world size 1: no outer step, the weights of plain training."""
    assert spawn.world(1).run(_one_rank, timeout=120) == [True]


# ---- units ---------------------------------------------------------------------------------------


def test_codec_names_agree() -> None:
    assert OUTER_COMPRESSIONS == outer_codec.CODECS


def test_sync_every_settings() -> None:
    assert parse_sync_every(None) == 0
    assert parse_sync_every("16") == 16
    assert parse_sync_every(" Auto ") == "auto"
    assert Config.from_env({"RINGTRAIN_SYNC_EVERY": "auto"}).sync_every == "auto"
    assert Config.from_env({"RINGTRAIN_SYNC_EVERY": "32"}).sync_every == "32"
    for bad in (-1, "often", True):
        with pytest.raises(ConfigError, match="sync_every"):
            parse_sync_every(bad)
    with pytest.raises(ConfigError, match="sync_every"):
        Config.from_env({"RINGTRAIN_SYNC_EVERY": "-3"})
    with pytest.raises(ConfigError, match="outer_compression"):
        Config.from_env({"RINGTRAIN_OUTER_COMPRESSION": "int2"})


def test_outer_delay_settings() -> None:
    assert [outer_delay(0, h) for h in (1, 3, 16, 100)] == [1, 1, 4, 25]  # a quarter round
    assert outer_delay(5, 16) == 5 and outer_delay(40, 16) == 16  # auto's H may be shorter
    config = Config.from_env(
        {"RINGTRAIN_OUTER_OVERLAP": "1", "RINGTRAIN_OUTER_DELAY": "2", "RINGTRAIN_SYNC_EVERY": "8"}
    )
    assert config.outer_overlap and config.outer_delay == 2
    local_settings.check(config)
    with pytest.raises(ConfigError, match="outer_delay must be"):
        Config.from_env({"RINGTRAIN_OUTER_DELAY": "-1"})
    with pytest.raises(ConfigError, match="outer_overlap is off"):
        local_settings.check(Config(sync_every="8", outer_delay=2))
    with pytest.raises(ConfigError, match="longer than a round"):
        local_settings.check(Config(sync_every="8", outer_overlap=True, outer_delay=9))
