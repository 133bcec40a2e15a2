"""The gradient engine behind DistributedOptimizer, against a one-process reference.

Every rank trains with DistributedOptimizer while also computing, locally, what one process
would compute on the global batch (the mean of every rank's loss). Same weights, float32
tolerance, means the engine averaged exactly the right gradients: with several buckets, with
parameters that get no gradient on some rank, with requires_grad changing between steps, with
sparse embeddings, with accumulation and no_sync.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from _training import DigitsNet, assert_same_weights, same_on_every_rank, train
from ringtrain.testing.spawn import World

TOL = {"rtol": 1e-5, "atol": 1e-6}
SMALL_BUCKETS = {"fusion_threshold_bytes": 512, "cycle_time_ms": 0.01}


def _batch(step: int, rank: int, j: int = 0, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + j)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; in the "unused" case rank 0 never uses head b."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh())
        self.a = torch.nn.Linear(16, 3)
        self.b = torch.nn.Linear(16, 3)
        self.emb = torch.nn.Embedding(20, 6, sparse=True)

    def forward(self, x: torch.Tensor, use_b: bool = True, idx: Any = None) -> torch.Tensor:
        if idx is not None:
            x = x + self.emb(idx)
        h = self.trunk(x)
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _loss(case: str, model: TwoHeads, step: int, rank: int, size: int, j: int = 0) -> torch.Tensor:
    x, y = _batch(step, rank, j)
    if case == "unused":  # rank 0 never touches head b (unless it is alone)
        return F.cross_entropy(model(x, use_b=rank != 0 or size == 1), y)
    if case in ("sparse", "sparse_as_dense"):
        g = torch.Generator().manual_seed(step * 7 + rank)
        idx = torch.randint(0, 20, (x.shape[0],), generator=g)
        # On odd steps rank 0 skips the embedding: its gradient is missing there.
        skip = step % 2 == 1 and rank == 0 and size > 1
        return F.cross_entropy(model(x, idx=None if skip else idx), y)
    return F.cross_entropy(model(x), y)


def _toggle(case: str, model: TwoHeads, step: int) -> None:
    """The "freeze" case: freeze and unfreeze parts between steps, alike on every rank."""
    if case != "freeze":
        return
    if step == 0:
        model.b.bias.requires_grad_(False)  # frozen from the start, unfrozen at step 3
    if step == 2:
        model.trunk[0].weight.requires_grad_(False)
    if step == 3:
        model.b.bias.requires_grad_(True)
    if step == 4:
        model.trunk[0].weight.requires_grad_(True)


def _train(case: str, steps: int, kwargs: dict[str, Any]) -> tuple[float, list[str]]:
    """Train with DistributedOptimizer and with the global-batch reference; returns the largest
    weight difference and the bucket plan digest of every step. A case ending in ":kept" zeroes
    gradients in place (``zero_grad(set_to_none=False)``), so they stay the buckets' views."""
    case, _, kept = case.partition(":")
    set_to_none = kept != "kept"
    r, n = rt.rank(), rt.size()
    torch.manual_seed(0)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    _toggle(case, model, 0)
    _toggle(case, ref, 0)
    k = kwargs.get("backward_passes_per_step", 1)
    make: Callable[[Any], torch.optim.Optimizer] = lambda m: torch.optim.SGD(  # noqa: E731
        m.parameters(), lr=0.1
    )
    opt = rt.DistributedOptimizer(
        make(model),
        named_parameters=model.named_parameters(),
        sparse_as_dense=case == "sparse_as_dense",
        **kwargs,
    )
    ref_opt = make(ref)
    digests = []
    for step in range(steps):
        _toggle(case, model, step)
        _toggle(case, ref, step)
        opt.zero_grad(set_to_none=set_to_none)
        if case == "no_sync":
            with opt.no_sync():
                for j in range(2):
                    (_loss(case, model, step, r, n, j) / 3).backward()
            (_loss(case, model, step, r, n, 2) / 3).backward()
        else:
            for j in range(k):
                (_loss(case, model, step, r, n, j) / k).backward()
        opt.step()
        digests.append(opt.plan.digest if opt.plan else "")
        ref_opt.zero_grad()
        passes = 3 if case == "no_sync" else k
        total = sum(_loss(case, ref, step, q, n, j) for q in range(n) for j in range(passes))
        (total / (n * passes)).backward()
        ref_opt.step()
    return assert_same_weights(model, ref, **TOL), digests


def _same_plan_everywhere(results: list[tuple[float, list[str]]]) -> list[str]:
    digests = [d for _, d in results]
    assert all(d == digests[0] for d in digests), f"bucket plans differ across ranks: {digests}"
    return digests[0]


def test_several_buckets_same_plan_on_every_rank(world: World) -> None:
    digests = _same_plan_everywhere(world.run(_train, "plain", 3, SMALL_BUCKETS))
    assert len(set(digests)) == 1  # learned once, then frozen


def test_parameters_without_gradient_on_one_rank_reduce_zeros(world: World) -> None:
    _same_plan_everywhere(world.run(_train, "unused", 3, SMALL_BUCKETS))


@pytest.mark.parametrize("case", ["plain:kept", "unused:kept", "freeze:kept", "no_sync:kept"])
def test_gradients_zeroed_in_place_stay_exact(world: World, case: str) -> None:
    # Kept gradients are the buckets' own views: scaled where they lie, never copied.
    world.run(_train, case, 4, SMALL_BUCKETS)
    if not case.startswith("no_sync"):  # no_sync is its own way of accumulating
        world.run(_train, case, 3, {"backward_passes_per_step": 2, **SMALL_BUCKETS})


def _planned_at_rate(rate: float) -> list[tuple[str, int]]:
    """(digest, buckets) after each step, with the learning step's measured rate replaced."""
    from ringtrain.engine import schedule

    saved = schedule.agree_rate
    schedule.agree_rate = lambda *args: rate  # type: ignore[assignment]
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(6)))
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            cycle_time_ms=0.001,  # every gap in backward may close a bucket
        )
        plans = []
        for step in range(3):
            x = torch.randn(4, 512, generator=torch.Generator().manual_seed(step))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            assert opt.plan is not None
            plans.append((opt.plan.digest, len(opt.plan.buckets)))
        return plans
    finally:
        schedule.agree_rate = saved  # type: ignore[assignment]


def test_the_first_exchange_picks_the_link_class_once(world2: World) -> None:
    slow, fast = world2.run(_planned_at_rate, 0.0), world2.run(_planned_at_rate, 1e12)
    for plans in (slow, fast):
        assert plans[0] == plans[1]  # the same plan on every rank
        assert len(set(plans[0])) == 1  # settled in the learning step, then frozen
    # Six 1 MiB layers: a slow link cuts 4 MiB buckets; a fast one sends all 6 MiB at once.
    assert slow[0][0][1] == 2 and fast[0][0][1] == 1
    # Pinned, the class wins over any measurement.
    assert world2.run(_planned_at_rate, 1e12, link_class="slow") == slow
    assert world2.run(_planned_at_rate, 0.0, link_class="fast") == fast


def test_timed_gaps_cut_buckets_only_when_not_reproducible(world2: World) -> None:
    slow = world2.run(_planned_at_rate, 0.0, reproducible=False)
    fast = world2.run(_planned_at_rate, 1e12, reproducible=False)
    for plans in (slow, fast):
        assert plans[0] == plans[1] and len(set(plans[0])) == 1
    # Unmeasured: gaps close buckets from 1 MiB; a fast link: one bucket is worth more.
    assert slow[0][0][1] >= 4 and fast[0][0][1] == 1


def _gradient_storage() -> tuple[int, int, bool]:
    """(buckets, distinct gradient storages, whether the storages stayed put across steps)."""
    torch.manual_seed(0)
    model = TwoHeads()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    where: list[set[int]] = []
    for step in range(4):
        opt.zero_grad(set_to_none=step % 2 == 0)  # fresh gradients, then kept ones
        _loss("plain", model, step, rt.rank(), rt.size()).backward()
        opt.step()
        where.append({p.grad.untyped_storage().data_ptr() for p in model.parameters()})
    assert opt.plan is not None
    return len(opt.plan.buckets), len(where[-1]), all(w == where[0] for w in where)


def test_gradients_are_views_of_their_buckets(world2: World) -> None:
    for buckets, storages, stayed in world2.run(_gradient_storage):
        assert storages == buckets  # every gradient lies in its bucket: nothing copied back
        assert stayed


def test_requires_grad_toggled_between_steps_replans_alike(world: World) -> None:
    digests = _same_plan_everywhere(world.run(_train, "freeze", 6, SMALL_BUCKETS))
    if world.size > 1:  # freezing and unfreezing gave new plans, and step 5 is back to step 4's
        assert digests[1] != digests[2] != digests[3] != digests[4]
        assert digests[4] == digests[5]


def test_sparse_embedding_sent_sparse_and_dense(world: World) -> None:
    _same_plan_everywhere(world.run(_train, "sparse", 4, SMALL_BUCKETS))
    _same_plan_everywhere(world.run(_train, "sparse_as_dense", 4, {}))


def test_accumulating_three_passes_equals_one_large_batch(world: World) -> None:
    world.run(_train, "plain", 3, {"backward_passes_per_step": 3, **SMALL_BUCKETS})


def test_no_sync_accumulates_locally(world: World) -> None:
    world.run(_train, "no_sync", 3, SMALL_BUCKETS)


def test_bucket_orders(world2: World) -> None:
    for order in ("reverse", "registration"):
        world2.run(_train, "plain", 2, {"bucket_order": order, "fusion_threshold_bytes": 512})


# ---- 16-bit compression ----------------------------------------------------------------------


def _compressed_error(compression: str) -> list[float]:
    """Largest error of compressed averaged gradients, relative to the largest gradient."""
    r, n = rt.rank(), rt.size()
    torch.manual_seed(0)
    model = TwoHeads()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        compression=compression,
        **SMALL_BUCKETS,
    )
    errors = []
    for step in range(3):  # the learning step, then steps that overlap backward
        ref = copy.deepcopy(model)
        exact = torch.autograd.grad(
            sum(_loss("plain", ref, step, q, n) for q in range(n)) / n,
            list(ref.parameters()),
            allow_unused=True,
        )
        opt.zero_grad()
        _loss("plain", model, step, r, n).backward()
        opt.synchronize()
        for p, e in zip(model.parameters(), exact):
            if e is None:  # the embedding is unused here: the engine reduced zeros
                e = torch.zeros_like(p)
            got = p.grad if p.grad is not None else torch.zeros_like(p)  # world size 1
            scale = float(e.abs().max()) or 1.0
            errors.append(float((got - e).abs().max()) / scale)
        with opt.skip_synchronize():
            opt.step()
    return errors


def test_fp16_and_bf16_stay_within_stated_tolerance(world: World) -> None:
    # fp16 keeps 11 significant bits, bf16 8: a few roundings of the averaged value.
    for compression, tol in (("fp16", 2e-3), ("bf16", 1.6e-2)):
        for errors in world.run(_compressed_error, compression):
            assert max(errors) <= tol, (compression, max(errors))
            if world.size > 1:  # and the wire really was 16-bit: float32 would be ~1e-7
                assert max(errors) > 1e-5, (compression, max(errors))


def _large_fp16_gradients() -> list[list[float]]:
    r, n = rt.rank(), rt.size()
    near = torch.nn.Parameter(torch.zeros(4))  # 6e4 per rank: the plain fp16 sum overflows
    huge = torch.nn.Parameter(torch.zeros(4))  # beyond fp16 even divided by the world size
    opt = rt.DistributedOptimizer(
        torch.optim.SGD([near, huge], lr=0.0),
        named_parameters=[("near", near), ("huge", huge)],
        compression=rt.Compression.fp16,
        fusion_threshold_bytes=0,
    )
    out = []
    for _ in range(2):
        opt.zero_grad()
        ((near * 6e4).sum() + (huge * 1e6 * (r + 1)).sum()).backward()
        opt.step()
        out.append([float(near.grad[0]), float(huge.grad[0]), float(n)])
    return out


def test_fp16_large_gradients_do_not_overflow(world: World) -> None:
    for steps in world.run(_large_fp16_gradients):
        for near, huge, n in steps:
            assert near == 6e4
            assert abs(huge - 1e6 * (n + 1) / 2) <= 1e-6 * huge


# ---- gradient reducers and the optimizer's state_dict -----------------------------------------


class MeanReducer:
    """A GradientReducer that averages exactly, counting its calls per bucket (its state)."""

    name = "test-mean"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.shapes: dict[str, Any] = {}

    def plan(self, bucket_key: str, shapes: Any) -> None:
        self.shapes[bucket_key] = shapes

    def reduce(self, bucket_key: str, flat: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        self.calls[bucket_key] = self.calls.get(bucket_key, 0) + 1
        out = flat.clone()
        dist.all_reduce(out, group=group)
        return out / dist.get_world_size(group)

    def state_dict(self) -> dict[str, Any]:
        return {"calls": dict(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls = dict(state["calls"])


def _reducer_and_state_dict() -> dict[str, Any]:
    import io

    r, n = rt.rank(), rt.size()

    def build() -> tuple[TwoHeads, rt.DistributedOptimizer, MeanReducer]:
        torch.manual_seed(0)
        model = TwoHeads()
        reducer = MeanReducer()
        opt = rt.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.01),
            named_parameters=model.named_parameters(),
            compression=reducer,
            **SMALL_BUCKETS,
        )
        return model, opt, reducer

    def plain(model: TwoHeads) -> Callable[[int], torch.Tensor]:
        return lambda step: _loss("plain", model, step, r, n)

    model, opt, reducer = build()
    train(opt, range(3), plain(model))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model2, opt2, reducer2 = build()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    restored_calls = dict(reducer2.calls)
    train(opt, range(3, 5), plain(model))
    train(opt2, range(3, 5), plain(model2))
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    mismatch = ""
    try:
        opt2.load_state_dict({**saved["opt"], "ringtrain_compressor": {"name": "x", "state": {}}})
    except rt.ConfigError as e:
        mismatch = str(e)
    return {
        "keys": sorted(reducer.calls) if n > 1 else [],
        "calls": reducer.calls,
        "restored": restored_calls,
        "has_key": "ringtrain_compressor" in saved["opt"],
        "same": same,
        "mismatch": mismatch,
        "planned": sorted(reducer.shapes),
    }


def test_gradient_reducer_and_state_dict_round_trip(world: World) -> None:
    results = world.run(_reducer_and_state_dict)
    for res in results:
        assert res["same"], "training diverged after restoring the optimizer's state_dict"
        assert "HINT" in res["mismatch"]
        if world.size > 1:
            assert res["has_key"] and res["keys"] == results[0]["keys"]
            assert len(res["keys"]) > 1 and res["planned"] == res["keys"]
            assert all(c == 3 for c in res["restored"].values())
            assert all(c == 5 for c in res["calls"].values())


def _powersgd_keeps_ranks_identical() -> bool:
    from ringtrain.compression import PowerSGDReducer

    r, n = rt.rank(), rt.size()
    torch.manual_seed(0)
    model = TwoHeads()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=PowerSGDReducer(start_iter=1),
        **SMALL_BUCKETS,
    )
    train(opt, range(4), lambda step: _loss("plain", model, step, r, n))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return same_on_every_rank(model) and finite


def test_powersgd_through_the_engine(world2: World) -> None:
    assert world2.run(_powersgd_keeps_ranks_identical) == [True, True]


def _dropped_optimizer_is_freed() -> tuple[bool, list[str], int, bool]:
    import gc
    import threading
    import time
    import weakref

    from ringtrain.compression import PowerSGDReducer
    from ringtrain.transport import Hold

    def reducers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("ringtrain-reducer")}

    # Only the threads this optimizer started count: a world's rank serves one test after
    # another, and another test's thread is that test's to check.
    before = reducers()
    r, n = rt.rank(), rt.size()
    model = TwoHeads()
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=PowerSGDReducer(start_iter=1),  # a reducer: the exchange has a thread
        **SMALL_BUCKETS,
    )
    train(opt, range(3), lambda step: _loss("plain", model, step, r, n))
    holds = [weakref.ref(o) for o in gc.get_objects() if isinstance(o, Hold)]
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    deadline = time.monotonic() + 30  # ends in milliseconds; a loaded machine can hold it back
    while reducers() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    threads = [t.name for t in reducers() - before]
    if threads:  # say what still holds it, for whoever reads the failure
        threads += [_holders(h) for h in holds if h() is not None] or ["no Hold left alive"]
    hooks = sum(
        len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters()
    )
    # The model trains on alone afterwards: nothing of the optimizer is left in its backward.
    _loss("plain", model, 9, r, n).backward()
    return gone() is None, threads, hooks, all(p.grad is not None for p in model.parameters())


def _holders(ref: Any) -> str:
    import gc

    held_by = [type(o).__name__ for o in gc.get_referrers(ref())]
    # The collector does not see what the world's rank froze at its start (module state).
    return f"a Hold alive, held by {held_by or 'module state'}"


def test_a_dropped_optimizer_frees_itself_and_its_threads(world2: World) -> None:
    # Hooks live in the parameters' C++ autograd data, where the garbage collector cannot see a
    # cycle through them: they hold the optimizer weakly, or it would live as long as the model.
    for freed, threads, hooks, trains in world2.run(_dropped_optimizer_is_freed):
        assert freed and threads == [] and hooks == 0 and trains


# ---- parity with torch DDP -------------------------------------------------------------------


class TinyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.block = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)).mean(1))


def _ddp_parity(model_name: str, k: int, steps: int) -> float:
    import contextlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    r = rt.rank()
    torch.manual_seed(0)
    model: torch.nn.Module = DigitsNet() if model_name == "cnn" else TinyTransformer()
    ddp = DDP(copy.deepcopy(model))
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=k,
    )
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    for step in range(steps):
        for j in range(k):
            g = torch.Generator().manual_seed(1000 * step + 10 * r + j)
            if model_name == "cnn":
                x = torch.randn(8, 1, 8, 8, generator=g)
            else:
                x = torch.randint(0, 32, (8, 5), generator=g)
            y = torch.randint(0, 10, (8,), generator=g)
            (F.cross_entropy(model(x), y) / k).backward()
            sync = contextlib.nullcontext() if j == k - 1 else ddp.no_sync()
            with sync:
                (F.cross_entropy(ddp(x), y) / k).backward()
        opt.step()
        opt.zero_grad()
        ddp_opt.step()
        ddp_opt.zero_grad()
    return assert_same_weights(model, ddp.module, **TOL)


def test_same_weights_as_torch_ddp(world2: World) -> None:
    for model_name in ("cnn", "transformer"):
        for k in (1, 2):
            world2.run(_ddp_parity, model_name, k, 20, timeout=90)


def _predivided(compression: str) -> list[float]:
    r = rt.rank()
    w = torch.nn.Parameter(torch.zeros(6))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD([w], lr=0.0),
        named_parameters=[("w", w)],
        compression=compression,
        gradient_predivide_factor=2.0,
    )
    out = []
    for scale in (1.0, 1e6):  # the second overflows fp16 and is redone in float32
        opt.zero_grad()
        (w * torch.arange(1.0, 7.0) * scale * (r + 1)).sum().backward()
        opt.step()
        out.append(float(w.grad[5]) / scale)
    return out


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16"])
def test_predivide_gives_the_average_on_every_wire(world: World, compression: str) -> None:
    n = world.size
    for got in world.run(_predivided, compression):
        for value in got:  # d/dw5 = 6 (r+1), averaged over ranks
            assert abs(value - 6 * (n + 1) / 2) <= 2e-2 * 6 * (n + 1) / 2, (compression, got)


def _horovod_grouping_args() -> list[str]:
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            num_groups=2,
        )
    return [str(w.message) for w in caught]


def test_horovod_grouping_arguments_are_accepted_and_ignored_aloud(world2: World) -> None:
    for messages in world2.run(_horovod_grouping_args):
        assert any("num_groups" in m and "ignored" in m for m in messages), messages
