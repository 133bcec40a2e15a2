"""DistributedOptimizer and broadcast_optimizer_state edge cases, checked against the values
Horovod's definitions give (horovod/torch/optimizer.py, functions.py), at 2 and 4 ranks."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import ringtrain as rt
from ringtrain.testing import spawn

SIZES = [2, 4]


@pytest.fixture(params=SIZES, ids=[f"np{n}" for n in SIZES])
def world(request: pytest.FixtureRequest) -> spawn.World:
    return spawn.world(request.param)


def _linear(r: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    """w = 0, input (r+1) * ones: the gradient of sum(w.x) is (r+1) on every entry."""
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    return model, torch.full((1, 2), float(r + 1))


# ---- built on ranks outside its process set ------------------------------------------------


def _outside_set() -> list[float]:
    r, n = rt.rank(), rt.size()
    members = [1] if n == 2 else [1, 3]
    ps = rt.add_process_set(members)
    model, x = _linear(r)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        process_set=ps,
    )
    for _ in range(2):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    rt.remove_process_set(ps)
    return model.weight.detach().flatten().tolist()


def test_outside_process_set_steps_on_local_gradients(world: spawn.World) -> None:
    """Horovod registers no hooks outside the set and synchronize() returns at once: the
    optimizer steps on the rank's own gradients; members step on the members' average."""
    members = [1] if world.size == 2 else [1, 3]
    avg = sum(m + 1 for m in members) / len(members)
    for r, w in enumerate(world.run(_outside_set)):
        g = avg if r in members else r + 1
        assert w == [-2 * g, -2 * g], f"rank {r}"


# ---- without named_parameters -------------------------------------------------------------


def _unnamed() -> tuple[list[float], str]:
    r = rt.rank()
    a, x = _linear(r)
    b = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        b.weight.zero_()
    base = torch.optim.SGD([{"params": a.parameters()}, {"params": b.parameters()}], lr=1.0)
    opt = rt.DistributedOptimizer(base)
    (a(x) + b(2 * x)).sum().backward()
    opt.step()
    got = a.weight.detach().flatten().tolist() + b.weight.detach().flatten().tolist()
    opt.zero_grad()
    (a(x) + b(x)).sum().backward()
    try:
        b(x).sum().backward()  # a second gradient before step(): the error names the parameter
    except rt.CollectiveArgumentError as e:
        message = str(e)
    else:
        message = ""
    opt.remove_hooks()
    return got, message


def test_unnamed_parameters_take_horovods_names(world: spawn.World) -> None:
    n = world.size
    mean = sum(r + 1 for r in range(n)) / n
    for got, message in world.run(_unnamed):
        assert got == [-mean, -mean, -2 * mean, -2 * mean]
        # Horovod's name for group 1, position 0.
        assert "'allreduce.noname.1.0'" in message


def test_duplicate_names_raise_value_error_before_init() -> None:
    """Horovod checks the names in the constructor, before anything needs init()."""
    assert not rt.is_initialized()
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    base = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    named = [*a.named_parameters(), *b.named_parameters()]
    with pytest.raises(ValueError, match=r"duplicate names: \['bias', 'weight'\]"):
        rt.DistributedOptimizer(base, named_parameters=named)
    with pytest.raises(ValueError, match="named_parameters must be an iterable of"):
        rt.DistributedOptimizer(base, named_parameters=list(a.parameters()))  # type: ignore[arg-type]
    assert not rt.is_initialized()


# ---- synchronize() then step() ------------------------------------------------------------


def _sync_then_step(skip: bool) -> tuple[list[float], list[str]]:
    r = rt.rank()
    model, x = _linear(r)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        op=rt.Sum,
    )
    model(x).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if skip:
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    opt.remove_hooks()
    return model.weight.detach().flatten().tolist(), [str(w.message) for w in caught]


def test_step_after_synchronize_warns_and_reduces_again(world: spawn.World) -> None:
    """Horovod: step() after synchronize() outside skip_synchronize() warns and synchronizes
    again; with Sum the summed gradients are summed once more (n * sum)."""
    n = world.size
    total = sum(r + 1 for r in range(n))
    for w, caught in world.run(_sync_then_step, False):
        assert w == [-n * total, -n * total]
        assert len(caught) == 1 and "skip_synchronize" in caught[0]
    for w, caught in world.run(_sync_then_step, True):
        assert w == [-total, -total]
        assert caught == []


# ---- sparse_as_dense with a sparse-only optimizer -----------------------------------------

ROWS, DIM, STEPS = 8, 3, 3


def _rows(r: int, step: int) -> torch.Tensor:
    return torch.tensor([r % ROWS, (r + step + 1) % ROWS, (2 * r + 3) % ROWS])


def _embedding() -> torch.nn.Embedding:
    torch.manual_seed(0)
    return torch.nn.Embedding(ROWS, DIM, sparse=True)


def _sparse_adam() -> tuple[list[list[float]], bool]:
    r = rt.rank()
    emb = _embedding()
    opt = rt.DistributedOptimizer(
        torch.optim.SparseAdam(emb.parameters(), lr=0.1),
        named_parameters=emb.named_parameters(),
        sparse_as_dense=True,
    )
    sparse = True
    for step in range(STEPS):
        opt.zero_grad()
        (emb(_rows(r, step)) * (r + 1)).sum().backward()
        opt.synchronize()
        sparse = sparse and emb.weight.grad is not None and emb.weight.grad.is_sparse
        with opt.skip_synchronize():
            opt.step()
    opt.remove_hooks()
    return emb.weight.detach().tolist(), sparse


def _sparse_reference(n: int) -> list[list[float]]:
    """Horovod's definition: average the densified gradients, hand them back as to_sparse()."""
    emb = _embedding()
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    for step in range(STEPS):
        grads = []
        for r in range(n):
            emb.zero_grad()
            (emb(_rows(r, step)) * (r + 1)).sum().backward()
            assert emb.weight.grad is not None
            grads.append(emb.weight.grad.to_dense())
        emb.weight.grad = (torch.stack(grads).sum(0) / n).to_sparse()
        opt.step()
    return emb.weight.detach().tolist()


def test_sparse_as_dense_trains_sparse_adam(world: spawn.World) -> None:
    want = torch.tensor(_sparse_reference(world.size))
    for got, sparse in world.run(_sparse_adam):
        assert sparse, "the reduced gradient must be handed back sparse"
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-6, atol=1e-6)


# ---- broadcast_optimizer_state on a fresh optimizer ---------------------------------------


class _Counting(torch.optim.Optimizer):
    """An optimizer with a scalar (non-tensor) state entry and tuple/str options."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], tag: str) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "tag": tag})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["count"] = st.get("count", 0) + 1
                st["acc"] = st.get("acc", torch.zeros_like(p)) + p.grad
                p.add_(p.grad, alpha=-group["lr"])


def _fresh_state(kind: str) -> dict[str, Any]:
    r = rt.rank()
    torch.manual_seed(7)
    model = torch.nn.Linear(3, 2)
    frozen = torch.nn.Linear(3, 1)
    frozen.requires_grad_(False)
    params = [*model.parameters(), *frozen.parameters()]
    base: torch.optim.Optimizer
    if kind == "adam":
        base = torch.optim.Adam(params, lr=0.01 * (r + 1), betas=(0.9 - 0.1 * r, 0.99))
    elif kind == "sgd":
        base = torch.optim.SGD(params, lr=0.1 * (r + 1), momentum=0.9, weight_decay=0.5)
    else:
        base = _Counting(params, lr=0.1 * (r + 1), betas=(0.5 + r, 0.7), tag=f"rank{r}")
    opt = rt.DistributedOptimizer(
        base,
        named_parameters=[*model.named_parameters()]
        + [(f"frozen.{k}", v) for k, v in frozen.named_parameters()],
    )
    before = [p.detach().clone() for p in model.parameters()]
    rt.broadcast_optimizer_state(opt, root_rank=0)
    out: dict[str, Any] = {
        "group": {k: v for k, v in base.param_groups[0].items() if k != "params"},
        "state": {
            i: {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in base.state[p].items()}
            for i, p in enumerate(params)
            if p in base.state
        },
        "grads": [None if p.grad is None else p.grad.tolist() for p in params],
        "moved": [(p.detach() - b).tolist() for p, b in zip(model.parameters(), before)],
        "before": [b.tolist() for b in before],
    }
    # The optimizer trains normally afterwards.
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    opt.remove_hooks()
    return out


@pytest.mark.parametrize("kind", ["adam", "sgd", "scalar"])
def test_broadcast_state_of_fresh_optimizer(world: spawn.World, kind: str) -> None:
    results = world.run(_fresh_state, kind)
    root = results[0]
    for res in results:
        # Every rank ends with the root's options and the state one zero-gradient step makes.
        assert res["group"] == root["group"]
        assert res["state"] == root["state"]
        assert sorted(res["state"]) == [0, 1], "state for the trainable parameters only"
        zeros = [[0.0] * 3] * 2, [0.0] * 2
        assert res["grads"][:2] == list(zeros) and res["grads"][2:] == [None, None]
    st = root["state"][0]
    if kind == "adam":
        assert root["group"]["lr"] == 0.01 and root["group"]["betas"] == (0.9, 0.99)
        assert st["step"] == 1.0 and st["exp_avg"] == [[0.0] * 3] * 2
        for res in results:  # Adam on a zero gradient does not move the parameters
            assert res["moved"] == [[[0.0] * 3] * 2, [0.0] * 2]
    elif kind == "sgd":
        # Horovod's step on zero gradients applies weight decay on every rank with its own lr:
        # buf = wd * p, p -= lr * buf.
        for r, res in enumerate(results):
            lr = 0.1 * (r + 1)
            w = torch.tensor(res["before"][0])
            torch.testing.assert_close(torch.tensor(res["moved"][0]), -lr * 0.5 * w)
        w0 = torch.tensor(root["before"][0])
        torch.testing.assert_close(torch.tensor(st["momentum_buffer"]), 0.5 * w0)
    else:
        assert root["group"]["betas"] == (0.5, 0.7) and root["group"]["tag"] == "rank0"
        assert st["count"] == 1 and st["acc"] == [[0.0] * 3] * 2


def _stateless(momentum_on: tuple[int, ...]) -> dict[str, Any]:
    """SGD with weight decay and momentum on the ranks ``momentum_on`` only (none: stateless
    everywhere), each rank's lr its own; what broadcast_optimizer_state left or raised."""
    r = rt.rank()
    torch.manual_seed(7)
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    momentum = 0.9 if r in momentum_on else 0.0
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=momentum, weight_decay=0.5)
    try:
        rt.broadcast_optimizer_state(sgd, root_rank=0)
    except rt.CollectiveArgumentError as e:
        return {"error": str(e)}
    moved = model.weight.detach() - before
    return {"lr": sgd.param_groups[0]["lr"], "state": len(sgd.state), "moved": moved, "w": before}


def test_a_stateless_optimizer_keeps_each_rank_s_own_options(world: spawn.World) -> None:
    # Horovod returns early when a zero-gradient step leaves no state: nothing is sent.
    for r, res in enumerate(world.run(_stateless, ())):
        assert res["lr"] == pytest.approx(0.1 * (r + 1)) and res["state"] == 0, res
        # The step on zero gradients applied weight decay with this rank's own lr.
        torch.testing.assert_close(res["moved"], -0.1 * (r + 1) * 0.5 * res["w"])


def test_state_on_some_ranks_only_is_an_error_on_every_rank(world: spawn.World) -> None:
    # Where Horovod would hang (rank 0 broadcasting to ranks that returned), every rank raises.
    n = world.size
    for res in world.run(_stateless, (0,)):
        assert res["error"].startswith(
            f"broadcast_optimizer_state: the optimizer has state on ranks [0] and none on ranks "
            f"{list(range(1, n))}"
        ), res
        assert "HINT: build the same optimizer" in res["error"]


def _lbfgs() -> str:
    model = torch.nn.Linear(2, 1)
    try:
        rt.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)
    except ValueError as e:
        return str(e)
    return ""


def test_lbfgs_state_is_refused(world: spawn.World) -> None:
    for message in world.run(_lbfgs):
        assert "LBFGS" in message


# ---- steps that come early, and calls out of order -------------------------------------------


def _early_step() -> tuple[list[float], list[str]]:
    r = rt.rank()
    model, x = _linear(r)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=3,
    )
    got = []
    for passes in (2, 3):  # an epoch's last, short accumulation; then a full one
        opt.zero_grad()
        for _ in range(passes):
            model(x).sum().backward()
        opt.step()  # Horovod reduces what the passes summed, and steps
        got.append(model.weight[0, 0].item())
    caught = []
    opt.zero_grad()
    model(x).sum().backward()
    try:
        opt.zero_grad()  # after one backward pass of 3: Horovod's AssertionError
    except AssertionError as e:
        caught.append(str(e))
    opt.synchronize()
    for _ in range(3):
        model(x).sum().backward()
    try:
        model(x).sum().backward()  # a 4th pass of 3
    except AssertionError as e:
        caught.append(str(e))
    opt.synchronize()
    opt.remove_hooks()
    return got, caught


def test_an_early_step_reduces_what_was_accumulated(world: spawn.World) -> None:
    """Horovod's synchronize() reduces every gradient whose passes did not reach
    backward_passes_per_step, as they stand (summed, not divided by the passes)."""
    mean = sum(r + 1 for r in range(world.size)) / world.size
    for got, caught in world.run(_early_step):
        assert got == [-2 * mean, -5 * mean]
        assert len(caught) == 2
        assert "before optimizer.step()" in caught[0] and "computed again" in caught[1]


def _set_passes() -> dict[str, Any]:
    """Horovod's set_backward_passes_per_step (horovod/torch/optimizer.py): sets the count and
    restarts every gradient's countdown; checked as the constructor checks the argument."""
    import ringtrain.torch as hvd
    from ringtrain.torch import optimizer as hvd_optimizer

    r = rt.rank()
    model, x = _linear(r)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters()
    )
    reexported = hvd_optimizer.DistributedOptimizer  # Horovod's module path
    out: dict[str, Any] = {"reexported": isinstance(opt, reexported)}
    said = []
    for bad in (0, -2):
        try:
            opt.set_backward_passes_per_step(bad)
        except rt.ConfigError as e:
            said.append(str(e))
        try:
            rt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=1.0), backward_passes_per_step=bad
            )
        except rt.ConfigError as e:
            said.append(str(e))
    out["bad"] = said
    opt.set_backward_passes_per_step(2)
    out["attribute"] = opt.backward_passes_per_step
    got = []
    for _ in range(2):  # two passes, one reduction of their sum
        model(x).sum().backward()
    opt.step()
    got.append(model.weight[0, 0].item())
    # Mid-accumulation (1 pass of 3): the countdown restarts, the pass taken stays summed.
    opt.set_backward_passes_per_step(3)
    opt.zero_grad()
    model(x).sum().backward()
    opt.set_backward_passes_per_step(2)
    for _ in range(2):
        model(x).sum().backward()
    opt.step()
    got.append(model.weight[0, 0].item())
    out["weights"] = got
    # After the step's last pass its gradients are on their way: refused alike, the step goes on.
    opt.zero_grad()
    for _ in range(2):
        model(x).sum().backward()
    try:
        opt.set_backward_passes_per_step(1)
    except AssertionError as e:
        out["late"] = str(e)
    opt.step()
    out["after_late"] = (opt.backward_passes_per_step, model.weight[0, 0].item())
    opt.remove_hooks()
    # Assigned, as Horovod scripts do, after the plan was built for 1 pass: with averaged passes
    # the scaling follows at once (it stayed 1/1, and the step took the sum of 2 passes).
    model, x = _linear(r)
    avg = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        average_aggregated_gradients=True,
    )
    model(x).sum().backward()
    avg.step()
    start = model.weight[0, 0].item()
    avg.backward_passes_per_step = 2
    avg.zero_grad()
    for _ in range(2):
        model(x).sum().backward()
    avg.step()
    out["assigned"] = (avg.backward_passes_per_step, model.weight[0, 0].item() - start)
    avg.remove_hooks()
    return out


@pytest.mark.timeout(300)
def test_set_backward_passes_per_step_restarts_the_count(world2: spawn.World) -> None:
    mean = sum(r + 1 for r in range(world2.size)) / world2.size
    for out in world2.run(_set_passes, timeout=240):
        assert out["reexported"]
        assert out["bad"] == [
            f"backward_passes_per_step must be >= 1, got {b}" for b in (0, 0, -2, -2)
        ]
        assert out["attribute"] == 2
        assert out["weights"] == [-2 * mean, -5 * mean]
        assert "backward_passes_per_step was changed after" in out["late"]
        assert out["after_late"] == (2, -7 * mean)
        assert out["assigned"] == (2, -mean)


def _wrapped_class() -> list[Any]:
    model, _ = _linear(rt.rank())
    opt = rt.DistributedOptimizer(torch.optim.Adam(model.parameters()))
    sgd = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    got = [type(opt).__name__, isinstance(opt, torch.optim.Adam), type(sgd).__name__]
    got += [isinstance(sgd, torch.optim.Adam), isinstance(opt, rt.DistributedOptimizer)]
    for bad in (-1, 0, "2"):
        with pytest.raises(ValueError, match="groups should be a positive integer"):
            rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=bad)
    # Horovod's checks of a list, with its words (horovod/torch/optimizer.py).
    w = model.weight
    for bad, said in (([[w, w]], "only appear once"), ([[w], [w]], "only appear once")):
        with pytest.raises(ValueError, match=said):
            rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=bad)
    for bad in ([[1, 2]], [["w"]], [3]):
        with pytest.raises(ValueError, match=r"groups must consist of torch\.Tensor"):
            rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), groups=bad)
    for o in (opt, sgd):
        o.remove_hooks()
    return got


def test_the_wrapper_is_an_instance_of_the_wrapped_class(world: spawn.World) -> None:
    """Horovod builds its optimizer's class with type(name, (optimizer.__class__,), ...)."""
    for got in world.run(_wrapped_class):
        assert got == ["Adam", True, "SGD", False, True]


def _horovod_groups(kwargs: dict[str, Any]) -> tuple[str, list[float], list[str]]:
    """Two steps of a 3-layer model with Horovod's groups=/num_groups= given (or none): the
    plan digest, the weights and the warnings the construction gave."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if kwargs.get("groups") == "list":
        kwargs = {"groups": [list(model[0].parameters()), list(model[2].parameters())]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = rt.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), **kwargs)
    x = torch.full((2, 4), float(rt.rank() + 1))
    for _ in range(2):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    assert opt.plan is not None
    digest = opt.plan.digest
    opt.remove_hooks()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return digest, weights, [str(w.message) for w in caught]


def test_horovods_groups_are_accepted_ignored_and_warned_of(world2: spawn.World) -> None:
    """docs/glossary.md (Group): a valid groups= or num_groups= warns once and changes
    nothing: the same bucket plan and the same weights as none."""
    plain = world2.run(_horovod_groups, {})[0]
    assert plain[2] == []
    for kwargs in ({"groups": 2}, {"num_groups": 2}, {"groups": "list"}):
        for digest, weights, caught in world2.run(_horovod_groups, kwargs):
            assert (digest, weights) == plain[:2], kwargs
            assert len(caught) == 1 and "groups=/num_groups=) is ignored" in caught[0], kwargs


def _layer_on_rank_0_only(what: str) -> dict[str, Any]:
    """Broadcast ``what`` ("parameters" or "optimizer") of a model whose second layer only rank
    0 builds; the error every rank got, and whether the job carries on after it."""
    layers = [torch.nn.Linear(3, 2)] + ([torch.nn.Linear(2, 1)] if rt.rank() == 0 else [])
    model = torch.nn.Sequential(*layers)
    try:
        if what == "parameters":
            rt.broadcast_parameters(model.state_dict(), root_rank=0)
        else:
            rt.broadcast_optimizer_state(torch.optim.Adam(model.parameters()), root_rank=0)
    except rt.CollectiveArgumentError as e:
        error = str(e)
    else:
        error = ""
    after = rt.allreduce(torch.ones(1), op=rt.Sum, name="after.mismatch")
    return {"error": error, "after": float(after)}


def test_parameters_named_on_some_ranks_only_are_an_error_on_every_rank(
    world2: spawn.World,
) -> None:
    # Horovod's ranks with fewer names return; rank 0 waits forever on '1.weight' (checked here
    # before the names were agreed: rank 1 returned, rank 0 hung).
    for res in world2.run(_layer_on_rank_0_only, "parameters"):
        assert res["error"].startswith(
            "broadcast_parameters: the ranks hold different tensors (by name):\n"
            "  rank 0: 4 tensors; only here: 1.bias, 1.weight\n"
            "  rank 1: 2 tensors; only here: none\nHINT: build the same model"
        ), res
        assert res["after"] == 2.0


def test_optimizers_over_other_parameters_are_an_error_on_every_rank(
    world2: spawn.World,
) -> None:
    # Horovod: rank 0 returns, rank 1 fails alone in torch's load_state_dict (checked here
    # before the shapes were agreed: rank 0 returned, rank 1 raised torch's ValueError).
    for res in world2.run(_layer_on_rank_0_only, "optimizer"):
        assert res["error"] == (
            "broadcast_optimizer_state: the optimizers hold different parameters (by shape):\n"
            "  rank(s) 0: 4 parameters in 1 group(s): group 0: [2, 3], [2], [1, 2], [1]\n"
            "  rank(s) 1: 2 parameters in 1 group(s): group 0: [2, 3], [2]\n"
            "HINT: build the same model and optimizer (the same parameter groups) on every rank "
            "before broadcasting the optimizer's state."
        ), res
        assert res["after"] == 2.0


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda: rt.broadcast_parameters("abc", 0), "or a list of tensors, got str"),
        (lambda: rt.broadcast_parameters([1, 2], 0), "its item 0 is of type int, not a (name,"),
        (
            lambda: rt.broadcast_optimizer_state(torch.nn.Linear(2, 1), 0),
            "expects an optimizer (a torch.optim.Optimizer or a DistributedOptimizer), got Linear",
        ),
    ],
)
def test_what_is_not_parameters_or_an_optimizer_is_named(call: Any, said: str) -> None:
    # Refused before any collective (no init needed): Horovod's errors here were a bare
    # unpacking ValueError and KeyError('state').
    with pytest.raises(rt.CollectiveArgumentError) as caught:
        call()
    assert said in str(caught.value)


# ---- built with other settings on some ranks -------------------------------------------------


def _settings_on_rank_1(kind: str) -> dict[str, Any]:
    r = rt.rank()
    model, x = _linear(r)
    other: dict[str, Any] = {
        "op": {"op": rt.Sum},
        "compression": {"compression": rt.Compression.fp16},
        "fusion": {"fusion_threshold_bytes": 1024},
    }[kind]
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        **(other if r == 1 else {}),
    )
    model(x).sum().backward()
    try:
        opt.step()
        error = ""
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    after = rt.allreduce(torch.ones(1), op=rt.Sum, name=f"after.settings.{kind}")
    return {"error": error, "after": float(after), "weight": model.weight.tolist()}


@pytest.mark.parametrize(
    ("kind", "line"),
    [
        ("op", "  op: rank 0 Average, rank 1 Sum"),
        ("compression", "  compression (as given): rank 0 none, rank 1 FP16Compressor"),
        ("fusion", "  fusion_threshold_bytes: rank 0 67108864, rank 1 1024"),
    ],
)
def test_optimizer_settings_that_differ_between_ranks_are_an_error_on_every_rank(
    world2: spawn.World, kind: str, line: str
) -> None:
    # The exchange is not negotiated: with Average on rank 0 and Sum on rank 1 both ranks
    # stepped with g0/2 + g1, no error; fp16 or a bucket size on one rank made Gloo abort.
    for res in world2.run(_settings_on_rank_1, kind):
        assert res["error"].startswith(
            "ConfigError: the DistributedOptimizer's settings differ between ranks:\n"
        ), res
        assert line in res["error"].splitlines(), res
        assert "HINT: every rank must build the optimizer with the same arguments" in res["error"]
        assert res["weight"] == [[0.0, 0.0]], res  # nothing stepped
        assert res["after"] == 2.0  # the job goes on
