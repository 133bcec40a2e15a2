"""Cross-iteration overlap (DistributedOptimizer(overlap=True)) against the same run without it.

Same plan, same reductions, same per-parameter updates: the weights must be bitwise equal after
every step, at 2 and 3 ranks, with SGD (momentum) and Adam, with 16-bit compression,
accumulation, no_sync and the synchronize()/skip_synchronize() pattern. With the sharded step
(shard_optimizer=True) too, against the sharded step without overlap. The contract tests check
what a user may rely on: parameters are final when a module's forward starts, after
synchronize(), in state_dict() (module's and optimizer's), and zero_grad() still zeroes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.engine.overlap import BucketTiming, launch_order
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World

# Spawning 3-rank worlds and training twice per test: slow on a shared 2-core machine.
pytestmark = pytest.mark.timeout(900)

# Several buckets, the same plan on every run (the link class pinned, as a comparison needs).
ENGINE = {"fusion_threshold_bytes": 4096, "link_class": "slow"}
# Generous: on a shared 2-core machine a rank may get a small share of a core.
TIMEOUT_S = 300.0


class Net(torch.nn.Module):
    """Embedding, attention (whose out_proj runs no forward of its own), MLP, head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)
        )
        self.head = torch.nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return self.head(x + self.mlp(x))


def _loss(model: torch.nn.Module, step: int, j: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rt.rank() + j)
    tokens = torch.randint(0, 32, (3, 6), generator=g)
    return F.cross_entropy(model(tokens).flatten(0, 1), torch.roll(tokens, 1, 1).flatten())


def _make(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(
            [
                {"params": list(model.emb.parameters()), "lr": 3e-3},
                {"params": [p for n, p in model.named_parameters() if not n.startswith("emb")]},
            ],
            lr=1e-2,
        )
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _run(
    kind: str, case: str, overlap: bool, steps: int, shard: bool = False, scatter: bool = False
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    k = 2 if case == "accumulate" else 1
    opt = rt.DistributedOptimizer(
        _make(kind, model),
        named_parameters=model.named_parameters(),
        compression="fp16" if case == "fp16" else "none",
        backward_passes_per_step=k,
        overlap=overlap,
        shard_optimizer=shard,
        reduce_scatter=scatter,
        **ENGINE,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for step in range(steps):
        opt.zero_grad()
        if case == "no_sync":
            with opt.no_sync():
                _loss(model, step, 1).backward()
        for j in range(k):
            (_loss(model, step, j) / k).backward()
        if case == "clip":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        sched.step()
    opt.synchronize()  # overlap: the last step's updates are final now
    assert opt.overlap == (overlap and rt.size() > 1)
    assert opt.shards_state == (shard and rt.size() > 1)
    return [p.detach().clone() for p in model.parameters()]


def _same_bits(
    kind: str, case: str, steps: int = 5, shard: bool = False, scatter: bool = False
) -> bool:
    plain = _run(kind, case, False, steps, shard, scatter)
    overlapped = _run(kind, case, True, steps, shard, scatter)
    return all(torch.equal(a, b) for a, b in zip(plain, overlapped))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("size", [2, 3])
def test_overlap_gives_the_same_bits(size: int, kind: str) -> None:
    from ringtrain.testing import spawn

    world = spawn.world(size)
    assert all(world.run(_same_bits, kind, "plain", timeout=TIMEOUT_S))


@pytest.mark.parametrize("case", ["fp16", "accumulate", "no_sync", "clip"])
def test_overlap_keeps_compression_accumulation_and_skipping(world2: World, case: str) -> None:
    assert all(world2.run(_same_bits, "adam", case, 4, timeout=TIMEOUT_S))


def _overlap_and_shards(size: int) -> bool:
    """Sharded and overlapped against sharded alone: Adam (torch's fused kernel on the shards)
    and SGD, with an LR scheduler stepping between step() and the updates, 16-bit
    compression, accumulation and clipping."""
    cases = [("adam", "plain"), ("sgd", "plain")]
    if size == 2:
        cases += [("adam", "fp16"), ("adam", "accumulate"), ("adam", "clip")]
    return all(_same_bits(kind, case, 4, shard=True) for kind, case in cases)


@pytest.mark.parametrize("size", [2, 3])
def test_overlap_with_the_sharded_step_gives_the_same_bits(size: int) -> None:
    from ringtrain.testing import spawn

    assert all(spawn.world(size).run(_overlap_and_shards, size, timeout=TIMEOUT_S))


def _overlap_and_scatter(size: int) -> bool:
    """Reduce-scattered gradients (reduce_scatter=True), overlapped against not: the same ring
    sums, the same shard steps, only their timing moves. 3 ranks: unequal shards."""
    cases = [("adam", "plain"), ("sgd", "plain")]
    if size == 2:
        cases += [("adam", "accumulate"), ("adam", "no_sync"), ("adam", "clip")]
    return all(_same_bits(kind, case, 4, shard=True, scatter=True) for kind, case in cases)


@pytest.mark.parametrize("size", [2, 3])
def test_overlap_with_reduce_scattered_gradients_gives_the_same_bits(size: int) -> None:
    from ringtrain.testing import spawn

    assert all(spawn.world(size).run(_overlap_and_scatter, size, timeout=TIMEOUT_S))


def _two_models_overflowing(overlap: bool) -> list[torch.Tensor]:
    """Two models, two fp16 optimizers, steps interleaved, losses scaled so that the 16-bit sums
    overflow: each overflowing bucket is reduced again in full precision, with overlap on the
    updater thread while the main thread launches the other model's buckets."""
    torch.manual_seed(0)
    models = (Net(), Net())
    opts = [
        rt.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=1e-9),
            named_parameters=m.named_parameters(),
            overlap=overlap,
            compression="fp16",
            **ENGINE,
        )
        for m in models
    ]
    for step in range(6):
        for m, o in zip(models, opts):
            o.zero_grad()
            (_loss(m, step) * 1e7).backward()
            o.step()
    for o in opts:
        o.synchronize()
    return [p.detach().clone() for m in models for p in m.parameters()]


def _two_overflowing_same_bits() -> bool:
    plain, overlapped = _two_models_overflowing(False), _two_models_overflowing(True)
    assert all(torch.isfinite(p).all() for p in plain)
    return all(torch.equal(a, b) for a, b in zip(plain, overlapped))


def test_two_overlapped_fp16_optimizers_redo_overflowing_buckets_alike(world2: World) -> None:
    assert all(world2.run(_two_overflowing_same_bits, timeout=TIMEOUT_S))


def _two_models(overlap: bool) -> list[torch.Tensor]:
    """A GAN's pattern: two models, two reduce-scattering optimizers, steps interleaved. With
    overlap, one's rings are still on the wire while the other's backward launches its own;
    on odd steps both backward passes run first, and the first model's gradients are gathered
    (synchronize(), clipped) while the second's rings are still on the wire."""
    torch.manual_seed(0)
    models = (Net(), Net())
    opts = [
        rt.DistributedOptimizer(
            _make("adam", m),
            named_parameters=m.named_parameters(),
            overlap=overlap,
            shard_optimizer=True,
            reduce_scatter=True,
            **ENGINE,
        )
        for m in models
    ]
    for step in range(5):
        if step % 2:
            for m, o in zip(models, opts):
                o.zero_grad()
                _loss(m, step).backward()
            opts[0].synchronize()
            torch.nn.utils.clip_grad_norm_(models[0].parameters(), 0.5)
            with opts[0].skip_synchronize():
                opts[0].step()
            opts[1].step()
            continue
        for m, o in zip(models, opts):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
    for o in opts:
        o.synchronize()
    return [p.detach().clone() for m in models for p in m.parameters()]


def _two_models_same_bits() -> bool:
    plain, overlapped = _two_models(False), _two_models(True)
    return all(torch.equal(a, b) for a, b in zip(plain, overlapped))


def test_two_overlapped_reduce_scattering_optimizers_give_the_same_bits(world2: World) -> None:
    assert all(world2.run(_two_models_same_bits, timeout=TIMEOUT_S))


def _contract(shard: bool = False, scatter: bool = False) -> dict[str, bool]:
    """One model steps with overlap, a copy without (both sharded, or neither); compare at
    every point the contract names."""
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = rt.DistributedOptimizer(
        _make("sgd", model),
        named_parameters=model.named_parameters(),
        overlap=True,
        shard_optimizer=shard,
        reduce_scatter=scatter,
        **ENGINE,
    )
    ref_opt = rt.DistributedOptimizer(
        _make("sgd", ref),
        named_parameters=ref.named_parameters(),
        shard_optimizer=shard,
        reduce_scatter=scatter,
        **ENGINE,
    )
    twin = dict(zip(model.parameters(), ref.parameters()))
    stale: list[str] = []
    names = {p: n for n, p in model.named_parameters()}

    def check(module: torch.nn.Module, _args: Any) -> None:
        # Runs after ringtrain's global pre-hook: the module's parameters must be final here,
        # out_proj's too (MultiheadAttention uses it without calling it).
        mine = list(module.parameters(recurse=module is model.attn))
        stale.extend(names[p] for p in mine if not torch.equal(p, twin[p]))

    for m in model.modules():
        m.register_forward_pre_hook(check)
    out: dict[str, bool] = {"final in forward": True, "state_dict": True, "opt state": True}
    for step in range(4):
        for m_, o_ in ((model, opt), (ref, ref_opt)):
            o_.zero_grad()
            _loss(m_, step).backward()
            o_.step()
        if step == 1:  # model.state_dict() right after step(): final values
            sd, ref_sd = model.state_dict(), ref.state_dict()
            out["state_dict"] = all(torch.equal(sd[k], ref_sd[k]) for k in sd)
        if step == 2:  # the optimizer's state_dict too (momentum buffers)
            a, b = opt.state_dict()["state"], ref_opt.state_dict()["state"]
            out["opt state"] = all(
                torch.equal(a[i]["momentum_buffer"], b[i]["momentum_buffer"]) for i in a
            )
    out["final in forward"] = not stale
    opt.zero_grad()  # deferred while updates are pending, applied with them
    opt.synchronize()
    out["synchronize"] = all(torch.equal(p, twin[p]) for p in model.parameters())
    out["zero_grad"] = all(p.grad is None for p in model.parameters())
    return out


@pytest.mark.parametrize(
    ("shard", "scatter"),
    [(False, False), (True, False), (True, True)],
    ids=["plain", "sharded", "reduce-scattered"],
)
def test_parameters_are_final_wherever_the_contract_says(
    world2: World, shard: bool, scatter: bool
) -> None:
    for result in world2.run(_contract, shard, scatter, timeout=TIMEOUT_S):
        assert result == dict.fromkeys(result, True), result


def _refused(what: str) -> str:
    model = Net()
    try:
        if what == "lbfgs":
            rt.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), overlap=True)
        elif what == "sharded-process-set":  # in a world of 3
            ps = rt.add_process_set([0, 1])
            try:
                rt.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1),
                    overlap=True,
                    shard_optimizer=True,
                    process_set=ps,
                )
            finally:
                rt.remove_process_set(ps)
        else:
            sparse = torch.nn.Embedding(32, 16, sparse=True)
            opt = rt.DistributedOptimizer(
                torch.optim.SGD(sparse.parameters(), lr=0.1), overlap=True
            )
            for _ in range(2):
                sparse(torch.tensor([[1, 2]])).sum().backward()
                opt.step()
                opt.zero_grad()
    except ConfigError as e:
        return str(e)
    return ""


@pytest.mark.parametrize(
    ("what", "says"),
    [
        ("lbfgs", "LBFGS"),
        ("sparse", "sparse_as_dense=True"),
    ],
)
def test_what_overlap_does_not_support_says_so(world2: World, what: str, says: str) -> None:
    messages = world2.run(_refused, what, timeout=TIMEOUT_S)
    assert all(says in msg for msg in messages), messages


def _sparse_first_step() -> tuple[str, bool]:
    """overlap=True with a sparse embedding: the first step is refused (it used to run, then
    fail at the second), before the reduction and with the weights as they were."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(8, 3, sparse=True)
    before = emb.weight.detach().clone()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=0.1),
        named_parameters=emb.named_parameters(),
        overlap=True,
    )
    emb(torch.tensor([1, 2 + rt.rank()])).sum().backward()
    said = "no error"
    try:
        opt.step()
    except ConfigError as e:
        said = str(e)
    unchanged = torch.equal(before, emb.weight)
    opt.remove_hooks()
    rt.barrier()  # every rank got here: none waits in a half-done exchange
    return said, unchanged


@pytest.mark.timeout(300)
def test_sparse_gradients_are_refused_at_the_first_step(world2: World) -> None:
    for said, unchanged in world2.run(_sparse_first_step, timeout=TIMEOUT_S):
        assert said.startswith("overlap=True needs dense gradients, but weight came sparse"), said
        assert unchanged


def _auto_overlapped(steps: int) -> dict[str, Any]:
    """compression="auto" with overlap: it measures whole steps without overlap, settles, then
    overlaps with what it chose."""
    torch.manual_seed(0)
    model = Net()
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01, foreach=False),
        named_parameters=model.named_parameters(),
        compression="auto",
        overlap=True,
        **ENGINE,
    )
    overlapped = 0
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        overlapped += bool(opt._path.schedule is not None and opt._path.schedule.open)
    opt.synchronize()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = rt.allgather(flat.reshape(1, -1))
    decided = opt.auto_decision is not None
    opt.remove_hooks()
    return {
        "alike": bool(torch.equal(every, every[:1].expand_as(every))),
        "decided": decided,
        "overlapped": overlapped,
    }


def test_auto_compression_measures_then_overlaps(world2: World) -> None:
    for result in world2.run(_auto_overlapped, 20, timeout=TIMEOUT_S):
        assert result["alike"] and result["decided"], result
        assert result["overlapped"] > 0, result


def test_overlap_with_shards_on_a_process_set_says_so() -> None:
    from ringtrain.testing import spawn

    messages = spawn.world(3).run(_refused, "sharded-process-set", timeout=TIMEOUT_S)
    assert all("world process set only" in msg for msg in messages), messages


def test_launch_order_sends_what_the_forward_needs_first_once_backward_ends() -> None:
    # Four equal buckets, ready in backward order (bucket 0 holds the last layers); the link
    # needs 10 ms per bucket, backward makes one ready every 5 ms.
    b = [BucketTiming(0.005 * i, 1_000_000, 30 - 10 * i) for i in range(4)]
    order = launch_order(b, 1e8)
    # Whenever the link is free it takes the ready bucket the forward needs first.
    assert order == [0, 2, 3, 1]
    # An infinitely fast link sends each bucket as it becomes ready.
    assert launch_order(b, 0.0) == [0, 1, 2, 3]


def _trace(path: str) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Overlapped steps while rank 1 launches late: (FORWARD spans, ALLREDUCE spans) of this
    rank's timeline, as (start, end) in microseconds."""
    import time

    from ringtrain.diagnostics import timeline

    torch.manual_seed(0)
    model = Net()
    opt = rt.DistributedOptimizer(
        _make("sgd", model), named_parameters=model.named_parameters(), overlap=True, **ENGINE
    )
    rt.start_timeline(path)
    name = timeline.rank_path(path, rt.rank())
    for step in range(4):
        opt.zero_grad()
        loss = _loss(model, step)
        if rt.rank() == 1 and step == 2:
            time.sleep(0.5)  # rank 0's buckets of step 2 stay in flight while it goes on
        loss.backward()
        opt.step()
    _loss(model, 4).backward()  # the FORWARD span ends at the next backward's first gradient
    opt.synchronize()
    rt.stop_timeline()
    events = timeline.load(name)
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}

    def spans(lane: str, what: str) -> list[tuple[float, float]]:
        return [
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("ph") == "X" and e["name"] == what and lanes[e["tid"]].startswith(lane)
        ]

    return spans("compute", "FORWARD"), spans("bucket", "ALLREDUCE")


def test_the_timeline_shows_the_forward_overlapping_the_exchange(
    world2: World, tmp_path: Any
) -> None:
    forwards, allreduces = world2.run(_trace, str(tmp_path / "trace.json"), timeout=TIMEOUT_S)[0]
    assert forwards, "no FORWARD span in rank 0's timeline"
    # Rank 0's forward after step 2 started while step 2's buckets were still on the wire.
    assert any(a0 < f0 < a1 for f0, _ in forwards for a0, a1 in allreduces)
