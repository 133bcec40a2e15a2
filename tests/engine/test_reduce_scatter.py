"""The sharded step with reduced-scattered gradients (``reduce_scatter=True``).

Each rank receives the sum of its own shard only, around a ring (ringtrain.transport.ring's
Ring over the engine's Gloo groups), instead of an allreduce of whole buckets. Shown here, on
2 and 3 ranks (3: shards of unequal sizes, an empty one where a bucket is smaller than the
ranks): the weights agree with the allreduce-based sharded step within float rounding (the ring
sums in another order), are bit for bit the same when the job runs again, are identical on
every rank; ``synchronize()`` called by the user gives whole reduced gradients (clipping works),
and the sealed group reduce-scatters too. Every other combination: tests/engine/test_matrix.py.
With overlap: tests/engine/test_overlap.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_sharded import Net, _batch  # this directory is on the path (rootless test modules)

import ringtrain as rt
from ringtrain.errors import ConfigError
from ringtrain.security import keys
from ringtrain.testing import spawn

pytestmark = pytest.mark.timeout(400)
# Small buckets: several of them, shards that cut parameters in the middle; a 3-element one.
SMALL = {"fusion_threshold_bytes": 2048, "link_class": "fast"}
# Another summation order of the same gradients: float rounding, compounded over the steps.
RING_TOL = 1e-5


def _train(scatter: bool, how: str = "", **kwargs: Any) -> tuple[Net, Any]:
    torch.manual_seed(0)
    model = Net()
    opt = rt.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01, foreach=False),
        named_parameters=model.named_parameters(),
        shard_optimizer=True,
        reduce_scatter=scatter,
        **{**SMALL, **kwargs},
    )
    for step in range(6):
        opt.zero_grad()
        x, y = _batch(step, rt.rank())
        F.cross_entropy(model(x), y).backward()
        if how == "clip":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return model, opt


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _alike_on_every_rank(t: torch.Tensor) -> bool:
    every = rt.allgather(t.reshape(1, -1))
    return torch.equal(every, every[:1].expand_as(every))


def _compare(how: str) -> tuple[float, bool, bool, bool]:
    """(largest difference to the allreduce-based sharded step, bitwise equal on a second run,
    weights identical on every rank, gradients identical on every rank after the last step)."""
    ring, _ = _train(True, how)
    again, _ = _train(True, how)
    reference, _ = _train(False, how)
    worst = float((_flat(ring) - _flat(reference)).abs().max())
    grads = torch.cat([p.grad.reshape(-1) for p in ring.parameters()])
    assert _alike_on_every_rank(torch.cat([p.grad.reshape(-1) for p in reference.parameters()]))
    return (
        worst,
        torch.equal(_flat(ring), _flat(again)),
        _alike_on_every_rank(_flat(ring)),
        _alike_on_every_rank(grads),
    )


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("how", ["", "clip"])
def test_weights_match_the_allreduce_and_repeat_bit_for_bit(size: int, how: str) -> None:
    for worst, repeated, alike, grads_alike in spawn.world(size).run(_compare, how, timeout=300):
        # A sum of two is the same in either order: bitwise equal at 2 ranks.
        assert worst == 0.0 if size == 2 else worst <= RING_TOL, worst
        assert repeated and alike
        # Only each rank's own shard was reduced, unless the user's synchronize() gathered them.
        assert grads_alike == (how == "clip")


def _gradients_after_synchronize() -> tuple[float, float]:
    """A user's synchronize() gives whole reduced gradients: the allreduce's (within rounding).
    (largest difference, largest value)."""
    out = []
    for scatter in (True, False):
        torch.manual_seed(0)
        model = Net()
        opt = rt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            shard_optimizer=True,
            reduce_scatter=scatter,
            **SMALL,
        )
        for step in range(2):  # the first step learns the plan; the second is steady
            opt.zero_grad()
            x, y = _batch(step, rt.rank())
            F.cross_entropy(model(x), y).backward()
            opt.synchronize()
            out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            with opt.skip_synchronize():
                opt.step()
    ring, reference = out[:2], out[2:]
    worst = max(float((a - b).abs().max()) for a, b in zip(ring, reference))
    return worst, max(float(b.abs().max()) for b in reference)


def test_synchronize_gives_whole_reduced_gradients() -> None:
    for worst, largest in spawn.world(3).run(_gradients_after_synchronize, timeout=300):
        assert largest > 0 and worst <= 1e-6 * max(1.0, largest), (worst, largest)


def _refusals() -> list[str]:
    said = []
    try:
        rt.DistributedOptimizer(
            torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1), reduce_scatter=True
        )
    except ConfigError as e:
        said.append(str(e))
    return said


def test_what_cannot_combine_is_refused_with_a_hint() -> None:
    """Only reduce_scatter without the sharded step is meaningless: every codec, hierarchical,
    and the sealed and tcp groups combine with it (tests/engine/test_matrix.py)."""
    (said,) = spawn.world(2).run(_refusals, timeout=300)[:1]
    assert len(said) == 1 and "shard_optimizer=True" in said[0] and "HINT" in said[0], said


def _sealed_against_gloo() -> tuple[bool, bool]:
    """(weights identical on every rank, the buckets were reduce-scattered)."""
    model, opt = _train(True)
    assert opt._exchange is not None
    return _alike_on_every_rank(_flat(model)), opt._exchange.scatters


def test_sealed_groups_reduce_scatter_without_deadlock(tmp_path: Path) -> None:
    """A sealed group runs the whole ring as one of its operations (ringtrain.transport): its
    one worker cannot run a posted receive before the paired send."""
    key_file = keys.write_key_file(tmp_path / "job.key", keys.generate_job_key())
    got = spawn.world(2).run(_sealed_against_gloo, timeout=300, secure=True, key_file=key_file)
    assert all(alike and scattered for alike, scattered in got), got
