"""``sync_every="auto"``: local updates only where synchronous training cannot reach 80%.

The policy (:func:`ringtrain.engine.auto.choose_sync_every`) on given link and compute figures
(a 25M-parameter model, 0.8 s of compute per step as issue 28 measured, 2 ranks, the link's
allreduce throughput), the first round's prediction of the synchronous step
(:mod:`ringtrain.engine.local_first`), then the choice on real ranks: no gradient exchange
before it; on loopback synchronous after one round, with one model and one optimizer state on
every rank, and a checkpoint keeps that; with the policy's answer fixed to local updates, every
rank holds the same weights after each outer step and a checkpoint keeps the H.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.compression.policy import Measurement, choose
from ringtrain.config import Config
from ringtrain.engine import auto, local_first, local_policy, local_settings, settings
from ringtrain.engine.auto import choose_sync_every
from ringtrain.errors import ConfigError
from ringtrain.testing import spawn

N = 25_000_000
MBIT = 1e6 / 8  # bytes per second of one Mbit/s


def _link(bytes_per_s: float, compute_s: float = 0.8) -> Measurement:
    """Uncompressed steps on a link of this throughput: the allreduce of 4N bytes, a fifth of
    it hidden behind backward."""
    comm = 2e-4 + 4 * N / bytes_per_s
    return Measurement(
        world_size=2,
        grad_bytes=4 * N,
        grad_numel=N,
        element_size=4,
        buckets=4,
        compute_s=compute_s,
        wait_s=max(0.0, comm - 0.2 * compute_s),
        comm_s=comm,
        latency_s=1e-4,
        bytes_per_s=bytes_per_s,
        powersgd_wire_numel=N // 150,
        powersgd_collectives=8,
        topk_ratio=0.01,
    )


def _decide(m: Measurement) -> tuple[int, str]:
    return choose_sync_every(m, choose(m).predicted_step_s)


@pytest.mark.parametrize("link", [4e9, 1000 * MBIT])
def test_fast_links_stay_synchronous(link: float) -> None:
    every, why = _decide(_link(link))
    assert every == 0
    assert "synchronous" in why and "at least 80%" in why


@pytest.mark.parametrize(("mbit", "compute_s"), [(10, 0.8), (100, 0.3)])
def test_slow_links_pick_local_updates(mbit: float, compute_s: float) -> None:
    m = _link(mbit * MBIT, compute_s)
    every, why = _decide(m)
    assert every in auto.SYNC_EVERY_CHOICES
    assert "under 80%" in why and f"every {every} steps" in why
    # The H of local_policy on the step's measured rate, and the log line names the codec,
    # the overlap and the predicted time to target per step.
    pick = local_policy.choose_local(
        m.grad_numel, 2, m.compute_s, m.in_step_bytes_per_s, m.op_overhead_s
    )
    assert every == pick.sync_every
    assert pick.outer.compression in why and "overlap" in why and "time to target" in why
    assert auto.outer_for(m, every, local_policy.NOT_GIVEN) == pick.outer


def test_explicit_outer_settings_are_honoured_in_the_prediction() -> None:
    m = _link(10 * MBIT, 0.3)
    every, why = choose_sync_every(m, choose(m).predicted_step_s, ("fp16", False, None))
    assert "fp16, not overlapped" in why and "as set (outer_compression, outer_overlap)" in why
    assert auto.outer_for(m, every, ("fp16", False, None)).compression == "fp16"
    assert every >= _decide(m)[0]  # the wider, exposed exchange needs at least as long a round


def _first_round(bytes_per_s: float, compute_s: float = 0.3, numel: int = N) -> Measurement:
    """The figures sync_every="auto"'s first round of local updates agrees on."""
    return local_first.measurement(numel, 2, 64 * 2**20, compute_s, 1e-4, bytes_per_s)


@pytest.mark.parametrize("how", ["argument", "variable"])
def test_outer_settings_given_at_their_defaults_are_honoured_and_named(how: str) -> None:
    # outer_compression="fp16" and outer_overlap=False are the Config's defaults: given, they
    # still win over what the slow link alone would pick (int4, overlapped).
    plain = Config.from_env({"RINGTRAIN_SYNC_EVERY": "auto"})
    if how == "argument":  # as DistributedOptimizer hands its arguments to the Config
        config = settings.resolve(plain, outer_compression="fp16", outer_overlap=False)
    else:
        config = Config.from_env(
            {
                "RINGTRAIN_SYNC_EVERY": "auto",
                "RINGTRAIN_OUTER_COMPRESSION": "fp16",
                "RINGTRAIN_OUTER_OVERLAP": "0",
            }
        )
    assert config == plain  # the same values: only what was given differs
    assert local_settings.given_outer(plain) == local_policy.NOT_GIVEN
    assert local_settings.given_outer(config) == ("fp16", False, None)
    m = _first_round(10 * MBIT)
    picked = local_first.decide(plain, m).outer
    assert picked is not None and (picked.compression, picked.overlap) == ("int4", True)
    choice = local_first.decide(config, m)
    outer = choice.outer
    assert outer is not None and (outer.compression, outer.overlap, outer.delay) == (
        "fp16",
        False,
        0,
    )
    # Predicted with the wide exchange in line: the policy's own answer on those settings.
    forced = local_policy.choose_local(
        m.grad_numel, 2, m.compute_s, m.in_step_bytes_per_s, m.op_overhead_s, "fp16", False
    )
    assert choice.sync_every == forced.sync_every
    line = local_first.line(choice)
    assert f"chose local updates every {choice.sync_every} steps: {choice.why}" in line
    assert "fp16, not overlapped" in line and "as set (outer_compression, outer_overlap)" in line
    assert f"{forced.predicted_time_per_step:.2f}x one host's" in line


def test_the_first_round_predicts_the_synchronous_step_it_did_not_take() -> None:
    # 1.3M floats in buckets of 1 MiB: 5 collectives, and every byte on the wire per step.
    m = local_first.measurement(1_300_000, 2, 2**20, 0.014, 0.002, 10 * MBIT)
    assert m.buckets == 5 and m.grad_bytes == 4 * 1_300_000
    step = local_first.predicted_step_s(m)
    wire = 4 * 1_300_000 / (10 * MBIT)
    assert step["none"] == pytest.approx(0.014 + 5 * 0.002 + wire)
    assert step["fp16"] == pytest.approx(0.014 + 5 * 0.002 + wire / 2)
    # Issue 40's MLP at 10 Mbit/s: local updates, int4 overlapped, named in one line.
    choice = local_first.decide(Config.from_env({"RINGTRAIN_SYNC_EVERY": "auto"}), m)
    assert choice.sync_every in local_policy.SYNC_EVERY_CHOICES and choice.outer is not None
    assert (choice.outer.compression, choice.outer.overlap) == ("int4", True)
    line = local_first.line(choice)
    assert "int4" in line and "overlapped (delay" in line and "time to target" in line
    # The same model on loopback's rate: synchronous after the first round, and it says so.
    fast = local_first.decide(
        Config(), local_first.measurement(1_300_000, 2, 2**20, 0.014, 5e-5, 2e9)
    )
    assert fast.sync_every == 0 and fast.outer is None
    assert "synchronous training after 16 steps of local updates" in local_first.line(fast)


def test_a_clashing_setting_is_synchronous_from_the_start() -> None:
    config = Config.from_env({"RINGTRAIN_SYNC_EVERY": "auto", "RINGTRAIN_SHARD_OPTIMIZER": "1"})
    clash = local_first.clash(config)
    assert clash is not None and clash.sync_every == 0 and "shard_optimizer" in clash.why
    assert local_first.line(clash, first_round=False).startswith(
        "ringtrain sync_every=auto chose synchronous training: shard_optimizer"
    )
    assert local_first.clash(Config.from_env({"RINGTRAIN_SYNC_EVERY": "auto"})) is None


def test_the_config_tells_a_given_setting_from_its_default() -> None:
    assert not Config.from_env({}).given("outer_overlap")
    assert Config.from_env({}, outer_overlap=False).given("outer_overlap")
    assert Config.from_env({"HOROVOD_CYCLE_TIME": "1"}).given("cycle_time_ms")
    replaced = Config.from_env({}, outer_compression="fp16").replace(sync_every="auto")
    assert replaced.given("outer_compression") and replaced.given("sync_every")
    assert not replaced.given("outer_delay")
    # Built directly, a Config counts the values other than the defaults.
    assert Config(outer_overlap=True).given("outer_overlap")
    assert not Config(outer_overlap=False).given("outer_overlap")
    with pytest.raises(ConfigError, match="unknown ringtrain setting 'outer_overlapp'"):
        Config().given("outer_overlapp")


def _small(
    numel: int, buckets: int, compute_s: float, wait_s: float, latency_s: float, rate: float
) -> Measurement:
    """A small model's step: the exchange in flight for all of the wait."""
    return Measurement(
        world_size=2,
        grad_bytes=4 * numel,
        grad_numel=numel,
        element_size=4,
        buckets=buckets,
        compute_s=compute_s,
        wait_s=wait_s,
        comm_s=wait_s,
        latency_s=latency_s,
        bytes_per_s=rate,
        powersgd_wire_numel=numel // 10,
        powersgd_collectives=2 * buckets,
        topk_ratio=0.01,
    )


def test_a_latency_bound_step_stays_synchronous() -> None:
    # A small model on a fast link: 8 ms of compute, 4 buckets at 1 ms each of fixed cost and
    # almost no bytes. Under 80%, but local updates would change the optimisation for nothing
    # the link's bandwidth costs.
    every, why = _decide(_small(1000, 4, 0.008, 0.004, 0.001, 4e9))
    assert every == 0
    assert "fixed cost" in why and "synchronous" in why


def test_a_busy_machine_is_not_a_slow_link() -> None:
    # The tiny model of the on-rank tests on loopback, measured on a loaded host: the step
    # waited 5x its compute (a preempted rank), but the probe's rate moves its 3 KiB in
    # microseconds. Local updates would change the optimisation and save nothing.
    every, why = _decide(_small(676, 1, 0.001, 0.005, 0.0001, 2e8))
    assert every == 0
    assert "not the link's bandwidth" in why and "synchronous" in why


def test_slower_link_needs_more_local_steps() -> None:
    assert _decide(_link(10 * MBIT, 0.3))[0] > _decide(_link(100 * MBIT, 0.3))[0]


def test_one_rank_is_synchronous() -> None:
    m = _link(10 * MBIT)
    one = Measurement(**{**m.__dict__, "world_size": 1})
    assert choose_sync_every(one, {"none": 1.0})[0] == 0


# ---- on ranks -----------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@contextlib.contextmanager
def _policy(every: int | None) -> Iterator[None]:
    """choose_sync_every answers ``every`` ("fixed by the test") inside, with the Config's
    outer exchange (in line, so the weights agree right after each outer step); None: the
    real one."""
    original, outer = auto.choose_sync_every, auto.outer_for
    if every is not None:
        auto.choose_sync_every = lambda m, p, g=None: (every, "fixed by the test")  # type: ignore[assignment]
        auto.outer_for = lambda m, e, g: None  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        auto.choose_sync_every, auto.outer_for = original, outer


def _auto_job() -> tuple[Tiny, Any]:
    torch.manual_seed(0)
    model = Tiny()
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every="auto",
    )
    return model, opt


def _step(model: Tiny, opt: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + rt.rank())
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _alike(*tensors: torch.Tensor) -> bool:
    """Whether every rank holds the same values (bit for bit)."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    every = rt.allgather(flat.reshape(1, -1))
    return torch.equal(every, every[:1].expand_as(every))


def _train(fixed: int | None, steps: int) -> dict[str, Any]:
    with _policy(fixed):
        model, opt = _auto_job()
        alike_after_outer, planned = [], []
        for i in range(steps):
            if not opt.sync_every_reason:  # not chosen yet: no gradient exchange so far
                planned.append(opt.plan is not None)
            _step(model, opt, 10 * i)
            local = opt.local_update
            if local is not None and local.inner_steps == 0:
                alike_after_outer.append(_alike(*model.parameters()))
    local = opt.local_update
    return {
        "reason": opt.sync_every_reason,
        "local": local is not None,
        "outer_steps": local.outer_steps if local is not None else 0,
        "alike": alike_after_outer,
        "planned_before_choice": any(planned),
        "steps_before_choice": len(planned),
    }


def _fast_link_then_resume(root: str) -> dict[str, Any]:
    """The real policy on loopback: synchronous after the first round, with one model and one
    Adam state on every rank; a checkpoint taken then resumes synchronous at once."""
    import ringtrain.checkpoint as ckpt

    model, opt = _auto_job()
    seen: dict[str, Any] = {"planned_before_choice": False}
    for i in range(local_first.START_H + 4):
        if opt.local_update is not None and opt.plan is not None:
            seen["planned_before_choice"] = True
        _step(model, opt, 10 * i)
        if i == local_first.START_H - 1:  # the round that chose has just ended
            seen["local_after_round"] = opt.local_update is not None
            state = [v for p in model.parameters() for v in opt.state[p].values()]
            seen["alike_at_switch"] = _alike(*model.parameters(), *state)
    seen["alike_after"] = _alike(*model.parameters())
    seen["reason"] = opt.sync_every_reason
    saved = ckpt.save(f"{root}/auto", model=model, optimizer=opt)
    model, opt = _auto_job()
    ckpt.load(saved, model=model, optimizer=opt)
    seen["resumed_local"] = opt.local_update is not None
    seen["resumed_reason"] = opt.sync_every_reason
    saved_sd = opt.state_dict()  # the optimizer's own state_dict keeps the choice too
    model, opt = _auto_job()
    opt.load_state_dict(saved_sd)
    seen["reloaded_local"] = opt.local_update is not None
    return seen


@pytest.mark.timeout(300)
def test_a_fast_link_goes_synchronous_after_one_round_with_one_state(tmp_path: Any) -> None:
    for r in spawn.world(2).run(_fast_link_then_resume, str(tmp_path), timeout=240):
        assert not r["planned_before_choice"]  # no gradient allreduce before the choice
        assert not r["local_after_round"] and r["alike_at_switch"] and r["alike_after"], r
        # Why varies with the machine's load (efficiency, or the collectives' fixed cost).
        assert r["reason"].endswith(("synchronous.", "fewer collectives).")), r
        assert not r["resumed_local"] and "restored from a checkpoint" in r["resumed_reason"]
        assert not r["reloaded_local"]


@pytest.mark.timeout(300)
def test_switch_to_local_updates_keeps_ranks_identical() -> None:
    # The first round (16 steps) chooses; the policy's answer fixed at H=3 from then on.
    for r in spawn.world(2).run(_train, 3, 22, timeout=240):
        assert r["local"] and r["reason"] == "fixed by the test"
        assert r["steps_before_choice"] == local_first.START_H and not r["planned_before_choice"]
        assert r["outer_steps"] == 3  # steps 16, 19 and 22
        assert r["alike"] and all(r["alike"])


def _clashing() -> dict[str, Any]:
    """sync_every="auto" with shard_optimizer, which local updates cannot use: synchronous
    from the first step (a gradient exchange, a bucket plan), and the reason says why."""
    model = Tiny()
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every="auto",
        shard_optimizer=True,
    )
    _step(model, opt, 0)
    return {"local": opt.local_update is not None, "planned": opt.plan is not None,
            "reason": opt.sync_every_reason}  # fmt: skip


@pytest.mark.timeout(120)
def test_a_clashing_setting_is_synchronous_from_the_first_step() -> None:
    for r in spawn.world(2).run(_clashing, timeout=90):
        assert not r["local"] and r["planned"], r
        assert "shard_optimizer is set" in r["reason"], r


def _refused() -> str:
    model = Tiny()
    try:
        rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            compression="powersgd",
            sync_every="auto",
        )
    except ConfigError as e:
        return str(e)
    return ""


@pytest.mark.timeout(120)
def test_explicit_compression_is_refused_with_auto() -> None:
    (msg,) = spawn.world(1).run(_refused, timeout=60)
    assert "sync_every='auto'" in msg and "HINT" in msg


def _save_then_resume(root: str) -> dict[str, Any]:
    """Train until sync_every="auto" has chosen local updates (fixed at H=3), checkpoint, and
    resume into a fresh optimizer whose policy would now say synchronous: the saved choice wins."""
    import ringtrain.checkpoint as ckpt

    with _policy(3):
        model, opt = _auto_job()
        for i in range(local_first.START_H + 4):
            _step(model, opt, 10 * i)
        assert opt.local_update is not None
        saved = ckpt.save(f"{root}/auto", model=model, optimizer=opt)
    with _policy(0):
        model, opt = _auto_job()
        ckpt.load(saved, model=model, optimizer=opt)
        for i in range(4):
            _step(model, opt, 100 + 10 * i)
    local = opt.local_update
    return {"local": local is not None, "reason": opt.sync_every_reason,
            "every": local.sync_every if local is not None else 0}  # fmt: skip


@pytest.mark.timeout(300)
def test_a_resumed_job_keeps_the_local_update_choice(tmp_path: Any) -> None:
    for r in spawn.world(2).run(_save_then_resume, str(tmp_path), timeout=240):
        assert r["local"] and r["every"] == 3, r
        assert "restored from a checkpoint" in r["reason"], r
