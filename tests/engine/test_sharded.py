"""The sharded optimizer step (shard_optimizer=True, ZeRO stage 1) against the unsharded engine.

Every rank trains two copies of one model on the same batches: one with the plain
DistributedOptimizer, one sharded. The gradients are exchanged alike (same plan, same sums), so
the weights must agree: bit for bit when both step with the same optimizer kernel, within float
tolerance when the shards take torch's fused kernel (the default: another order of the same
element-wise arithmetic). Also: optimizer state per rank ~1/N, checkpoints interchangeable with
the unsharded mode, broadcast_optimizer_state, and clear errors for what it cannot do.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.testing import spawn

# Worlds of 4 ranks on a busy 2-core machine: the first call in a fresh world imports torch.
pytestmark = pytest.mark.timeout(400)
SIZES = [2, 4]
# Small buckets: several buckets, and shards that cut parameters in the middle.
SMALL = {"fusion_threshold_bytes": 2048, "link_class": "fast"}
# Fused kernels vs torch's default single-tensor loop: same formulas, another rounding order.
FUSED_TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(params=SIZES, ids=[f"np{n}" for n in SIZES])
def world(request: pytest.FixtureRequest) -> spawn.World:
    return spawn.world(request.param)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 24)
        self.b = torch.nn.Linear(24, 24)
        self.c = torch.nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _batch(step: int, rank: int, j: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + j)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def _make(kind: str, model: Net) -> torch.optim.Optimizer:
    # Two groups with their own settings: shards take each parameter's own group's.
    groups: list[dict[str, Any]] = [
        {"params": [*model.a.parameters(), *model.c.parameters()]},
        {"params": list(model.b.parameters()), "lr": 0.02},
    ]
    if kind.startswith("sgd"):
        foreach = False if kind == "sgd-loop" else None
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-3, foreach=foreach)
    if kind == "adam-loop":  # the single-tensor implementation on both sides
        return torch.optim.Adam(groups, lr=0.01, foreach=False)
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=0.01)
    return torch.optim.Adam(groups, lr=0.01)


def _run(model: Net, opt: Any, steps: range, k: int = 1, sched: Any = None, how: str = "") -> None:
    """``how``: "no_sync" runs 3 passes, the first two inside ``no_sync()``; "clip" clips the
    averaged gradients between ``synchronize()`` and ``step()``."""
    r = rt.rank()
    for step in steps:
        opt.zero_grad()
        if how == "no_sync":
            with opt.no_sync():
                for j in range(2):
                    x, y = _batch(step, r, j)
                    (F.cross_entropy(model(x), y) / 3).backward()
            x, y = _batch(step, r, 2)
            (F.cross_entropy(model(x), y) / 3).backward()
        else:
            for j in range(k):
                x, y = _batch(step, r, j)
                (F.cross_entropy(model(x), y) / k).backward()
        if how == "clip":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        if sched is not None:
            sched.step()


def _pair(kind: str, kwargs: dict[str, Any]) -> tuple[Net, Any, Net, Any]:
    torch.manual_seed(0)
    plain = Net()
    shard = copy.deepcopy(plain)
    opts = []
    args = {k: v for k, v in kwargs.items() if k != "how"}
    for model, on in ((plain, False), (shard, True)):
        if kwargs.get("compression") == "powersgd-now":  # a fresh reducer per optimizer
            args["compression"] = rt.Compression.powersgd(start_iter=0)
        opts.append(
            rt.DistributedOptimizer(
                _make(kind, model),
                named_parameters=model.named_parameters(),
                shard_optimizer=on,
                **args,
            )
        )
    return plain, opts[0], shard, opts[1]


def _same_weights(kind: str, kwargs: dict[str, Any]) -> tuple[float, bool, int, int]:
    """(largest difference, bitwise equal, state bytes unsharded, sharded) after 6 steps."""
    k = kwargs.get("backward_passes_per_step", 1)
    plain, p_opt, shard, s_opt = _pair(kind, kwargs)
    for model, opt in ((plain, p_opt), (shard, s_opt)):
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        _run(model, opt, range(6), k, sched, kwargs.get("how", ""))
    worst, exact = 0.0, True
    for a, b in zip(plain.parameters(), shard.parameters()):
        worst = max(worst, float((a - b).abs().max()))
        exact = exact and torch.equal(a, b)
    # Every rank holds the same full weights.
    flat = torch.cat([p.detach().reshape(-1) for p in shard.parameters()])
    every = rt.allgather(flat.reshape(1, -1))
    assert torch.equal(every, every[:1].expand_as(every)), "ranks hold different weights"
    return worst, exact, p_opt.state_bytes, s_opt.state_bytes


@pytest.mark.parametrize(
    "kind,kwargs",
    [
        ("adam-loop", SMALL),
        ("sgd-loop", SMALL),
        ("sgd-loop", {**SMALL, "op": rt.Sum}),
        ("sgd", SMALL),
        ("adam", SMALL),
        ("adamw", {**SMALL, "backward_passes_per_step": 2}),
        ("adam", {**SMALL, "compression": "fp16"}),
        ("adam", {"link_class": "fast"}),  # one bucket
        ("sgd-loop", {**SMALL, "how": "no_sync"}),
        ("adam-loop", {**SMALL, "how": "clip"}),
        ("adam-loop", {**SMALL, "engine_streams": 2}),
        ("sgd-loop", {**SMALL, "compression": "powersgd-now"}),
    ],
    ids=[
        "adam-loop",
        "sgd-loop",
        "sgd-loop-sum",
        "sgd-fused",
        "adam-fused",
        "adamw-accumulate",
        "adam-fp16",
        "one-bucket",
        "sgd-no_sync",
        "adam-clip",
        "adam-lanes",
        "sgd-powersgd",
    ],
)
def test_same_weights_as_unsharded(world: spawn.World, kind: str, kwargs: dict[str, Any]) -> None:
    for worst, exact, full, mine in world.run(_same_weights, kind, kwargs, timeout=300):
        if kind.endswith("-loop"):
            # Same kernel, same element-wise arithmetic, same sums: the same bits.
            assert exact, f"{kind}: differs by {worst}"
        else:
            assert worst <= 1e-5, f"{kind}: differs by {worst}"
        # The state of 1/N of the elements, plus per-piece scalars (Adam's step).
        assert mine <= full / world.size * 1.25 + 64 * 8, (full, mine)


def _state_round_trip() -> list[float]:
    """Sharded and unsharded state_dicts hold the same full state; each loads into the other
    mode and training goes on alike."""
    plain, p_opt, shard, s_opt = _pair("adam-loop", SMALL)
    for model, opt in ((plain, p_opt), (shard, s_opt)):
        _run(model, opt, range(3))
    sd_plain, sd_shard = p_opt.state_dict(), s_opt.state_dict()  # every rank: it gathers
    assert sd_plain["param_groups"] == sd_shard["param_groups"]
    assert sd_plain["state"].keys() == sd_shard["state"].keys()
    for i, st in sd_plain["state"].items():
        assert st.keys() == sd_shard["state"][i].keys()
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd_shard["state"][i][key])), (
                i,
                key,
            )
    # Swap: the sharded model resumes from the unsharded checkpoint and vice versa.
    p_opt.load_state_dict(copy.deepcopy(sd_shard))
    s_opt.load_state_dict(copy.deepcopy(sd_plain))
    assert not s_opt.optimizer.state, "the loaded state must move into the shards"
    for model, opt in ((plain, p_opt), (shard, s_opt)):
        _run(model, opt, range(3, 6))
    # A fresh sharded optimizer loads a checkpoint before its first step.
    fresh_model = copy.deepcopy(plain)
    fresh = rt.DistributedOptimizer(
        _make("adam-loop", fresh_model),
        named_parameters=fresh_model.named_parameters(),
        shard_optimizer=True,
        **SMALL,
    )
    fresh.load_state_dict(p_opt.state_dict())
    for model, opt in ((fresh_model, fresh), (shard, s_opt), (plain, p_opt)):
        _run(model, opt, range(6, 8))
    return [
        max(float((a - b).abs().max()) for a, b in zip(plain.parameters(), m.parameters()))
        for m in (shard, fresh_model)
    ]


def test_state_dict_round_trip(world: spawn.World) -> None:
    for diffs in world.run(_state_round_trip, timeout=300):
        assert diffs == [0.0, 0.0]


def _broadcast() -> bool:
    r = rt.rank()
    torch.manual_seed(0)
    model = Net()
    opt = rt.DistributedOptimizer(
        _make("adam-loop", model),
        named_parameters=model.named_parameters(),
        shard_optimizer=True,
        **SMALL,
    )
    _run(model, opt, range(2))
    rt.broadcast_optimizer_state(opt, root_rank=0)
    sd = opt.state_dict()
    flat = torch.cat([st["exp_avg"].reshape(-1) for _, st in sorted(sd["state"].items())])
    every = rt.allgather(flat.reshape(1, -1))
    # Before any state, too: a fresh sharded optimizer takes the root's.
    fresh_model = Net()
    fresh = rt.DistributedOptimizer(
        torch.optim.Adam(fresh_model.parameters(), lr=0.1 * (r + 1)), shard_optimizer=True
    )
    rt.broadcast_optimizer_state(fresh, root_rank=0)
    return bool(torch.equal(every, every[:1].expand_as(every))) and fresh.param_groups[0][
        "lr"
    ] == pytest.approx(0.1)


def test_broadcast_optimizer_state(world: spawn.World) -> None:
    assert all(world.run(_broadcast, timeout=300))


def _process_set() -> list[float]:
    members = [1, 3] if rt.size() == 4 else [1]  # never the world's ranks: the global set's
    ps = rt.add_process_set(members)
    try:
        torch.manual_seed(0)
        plain = Net()
        shard = copy.deepcopy(plain)
        opts = [
            rt.DistributedOptimizer(
                _make("sgd-loop", m),
                named_parameters=m.named_parameters(),
                process_set=ps,
                shard_optimizer=on,
                **SMALL,
            )
            for m, on in ((plain, False), (shard, True))
        ]
        for m, opt in zip((plain, shard), opts):
            _run(m, opt, range(3))
        return [float((a - b).abs().max()) for a, b in zip(plain.parameters(), shard.parameters())]
    finally:
        rt.remove_process_set(ps)


def test_process_set(world: spawn.World) -> None:
    for diffs in world.run(_process_set, timeout=300):
        assert max(diffs) == 0.0


def _error(case: str) -> str:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    try:
        if case == "lbfgs":
            rt.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), shard_optimizer=True)
            return "no error"
        if case == "sparseadam":
            rt.DistributedOptimizer(
                torch.optim.SparseAdam(model[0].parameters()), shard_optimizer=True
            )
            return "no error"
        if case == "channels_last":
            conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
            opt = rt.DistributedOptimizer(
                torch.optim.SGD(conv.parameters(), lr=0.1),
                named_parameters=conv.named_parameters(),
                shard_optimizer=True,
            )
            conv(torch.ones(1, 3, 5, 5)).sum().backward()
            opt.step()
            return "no error"
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            shard_optimizer=True,
            sparse_as_dense=case == "closure",
        )
        closure: Callable[[], float] | None = (lambda: 0.0) if case == "closure" else None
        model(torch.tensor([[1, 2]])).sum().backward()
        opt.step(closure)
    except rt.ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case,words",
    [
        ("lbfgs", "cannot shard LBFGS"),
        ("sparse", "sparse_as_dense=True"),
        ("closure", "step(closure) is not supported"),
        ("sparseadam", "cannot shard SparseAdam"),
        ("channels_last", "'weight' is not contiguous (e.g. channels_last)"),
    ],
)
def test_unsupported_is_a_clear_error(case: str, words: str) -> None:
    for msg in spawn.world(2).run(_error, case, timeout=300):
        assert words in msg, msg


def _closure_first_step() -> tuple[str, bool]:
    """step(closure) with shard_optimizer=True at the very first step, no backward before:
    refused there (it used to run whole, then fail at the second step), nothing updated."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        shard_optimizer=True,
    )
    x = torch.ones(4, 3) * (rt.rank() + 1)

    def closure() -> float:
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return float(loss)

    said = "no error"
    try:
        opt.step(closure)
    except rt.ConfigError as e:
        said = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()  # the job goes on without the closure, alike on every rank
    return said, unchanged


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [1, 2])
def test_step_closure_is_refused_at_the_first_step(size: int) -> None:
    for said, unchanged in spawn.world(size).run(_closure_first_step, timeout=240):
        assert "step(closure) is not supported with shard_optimizer=True" in said, said
        assert unchanged


def _env_twin() -> bool:
    model = torch.nn.Linear(3, 2)
    return rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)).shards_state


def test_config_variable_turns_it_on() -> None:
    w = spawn.world(2)
    assert w.run(_env_twin, env={"RINGTRAIN_SHARD_OPTIMIZER": "1"}, timeout=300) == [True, True]
    assert w.run(_env_twin, timeout=300) == [False, False]
    # One rank: nothing to shard, the plain optimizer.
    one = spawn.world(1).run(_env_twin, env={"RINGTRAIN_SHARD_OPTIMIZER": "1"}, timeout=300)
    assert one == [False]
