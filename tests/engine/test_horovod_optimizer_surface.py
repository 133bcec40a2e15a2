"""What Horovod scripts read off the optimizer (issue 27, b and c), at 2 and 4 ranks.

* ``step()`` after ``synchronize()`` without ``skip_synchronize()`` warns once, in Horovod's
  words (scripts filter on them), and reduces again, as Horovod's does; inside
  ``skip_synchronize()`` it does not warn.
* ``optimizer._parameter_names`` maps each parameter to its name.
* the constructor takes Horovod's positional order.
* ``op=Adasum`` on one rank is the plain optimizer, as Horovod's factory makes it; on more ranks
  it raises ``NotImplementedError``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(600)

HOROVOD_TEXT = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)


def _surface() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    out: dict[str, Any] = {}
    names = opt._parameter_names
    out["names"] = {names[p]: n for n, p in model.named_parameters()}
    unnamed = rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    out["unnamed"] = [unnamed._parameter_names[p] for p in model.parameters()]
    unnamed.remove_hooks()
    # Horovod's positional order (horovod/torch/optimizer.py): ..., gradient_predivide_factor,
    # num_groups, groups, sparse_as_dense, process_set; ringtrain's own arguments come by name.
    args = (rt.Compression.none, 1, rt.Average, 1.0, 0, None, False, rt.global_process_set)
    positional = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), *args
    )
    out["positional"] = positional._process_set is rt.global_process_set
    positional.remove_hooks()
    with pytest.raises(TypeError):
        rt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, *args, True)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(rt.rank()))
    for skip in (False, True):
        opt.zero_grad()
        F.mse_loss(model(x), torch.zeros(5, 2)).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
        out[f"warnings_skip={skip}"] = [str(w.message) for w in caught]
    # A script that filters on Horovod's words silences it.
    opt.zero_grad()
    F.mse_loss(model(x), torch.zeros(5, 2)).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="optimizer.step\\(\\) called without")
        opt.step()
    out["filtered"] = len(caught)
    opt.remove_hooks()
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_horovod_warning_and_parameter_names(size: int) -> None:
    try:
        results = spawn.world(size).run(_surface, timeout=300)
    finally:
        if size == 4:
            spawn.close(4)  # a 4-rank world only this test uses
    for out in results:
        assert out["names"] == {
            "0.weight": "0.weight",
            "0.bias": "0.bias",
            "1.weight": "1.weight",
            "1.bias": "1.bias",
        }
        # horovod/torch/optimizer.py since process sets: f"allreduce.noname.{i}.{j}", i the
        # param group, j the position in it (older releases used "allreduce.noname.%s" % j).
        assert out["unnamed"] == [f"allreduce.noname.0.{j}" for j in range(4)]
        assert out["warnings_skip=False"] == [HOROVOD_TEXT], out
        assert out["warnings_skip=True"] == [], out
        assert out["filtered"] == 0
        assert out["positional"]


def _adasum_step(op: Any = rt.Adasum) -> list[float] | str:
    """One SGD step (lr 0.5) through DistributedOptimizer(op=op): the weight's change, or
    the error's type and words."""
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    try:
        opt = rt.DistributedOptimizer(sgd, model.named_parameters(), op=op)
    except (NotImplementedError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    model(torch.tensor([[1.0, 2.0]])).sum().backward()
    opt.step()
    opt.remove_hooks()
    return model.weight.detach().flatten().tolist()


def test_adasum_on_one_rank_is_the_plain_optimizer(world2: spawn.World) -> None:
    # horovod/torch/optimizer.py: `if op != Adasum or size() == 1:` gives the regular
    # _DistributedOptimizer, whose Adasum of one rank's gradient is that gradient.
    assert spawn.world(1).run(_adasum_step, timeout=120) == [[-0.5, -1.0]]
    for out in world2.run(_adasum_step, timeout=120):
        assert isinstance(out, str) and "Adasum is not supported" in out, out
    # Min, Max, Product: Horovod hands them to its allreduce; no gradient means them. Refused.
    for op in (rt.Min, rt.Max, rt.Product):
        for out in world2.run(_adasum_step, op, timeout=120):
            assert out == f"ConfigError: DistributedOptimizer supports op=Average or Sum, got {op}"
