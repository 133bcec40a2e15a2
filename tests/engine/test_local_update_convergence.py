"""Local updates converge like synchronous training at equal samples (digits, 2 ranks).

The demo's CNN on scikit-learn's digits (ringtrain.bench.converge's data and split), Adam
(lr 1e-3) inside, 32 samples per rank and step, the same seeds and steps for every setting:

* ``sync``: synchronous DistributedOptimizer (gradients averaged every step);
* ``local-8``: ``sync_every=8``, the default outer optimizer (Nesterov, lr 0.7, momentum 0.9),
  16-bit outer exchange;
* ``local-8-int4``: the same with a 4-bit outer exchange (error feedback);
* ``local-8-int4-overlap``: the same with the exchange overlapped, its average applied 2 inner
  steps late (``outer_overlap=True``, the default delay);
* ``local-8-int4-overlap-4-fragments``: the same in 4 fragments, one exchanged every 2 inner
  steps, each applied 2 steps late (``outer_fragments=4``, streaming DiLoCo).

Held-out accuracy is averaged over the evaluations every ``EVAL_EVERY`` steps in the last
``EVAL_LAST`` (right after an outer step, where the ranks hold identical weights; overlapped:
right after the average is applied, of the anchor, which then holds the same samples as
synchronous training's weights two steps before).

The claim is statistical. One run's accuracy depends on its seed (initial weights, batch order)
and, through the last bits of float sums, on the CPU's kernels; the held-out fifth of digits is
360 images, so one image is 0.28 points, and one seed's drop from synchronous scatters by about
0.4 points (``MEASURED``). A bound on one seed is a coin toss on some machine (issue 39: 0.5
points failed at 0.51 on an AMD EPYC). So each setting's drop is averaged over ``SEEDS``, each
seed on another ATen CPU capability's kernels (default, avx2, avx512, as far as the CPU has
them), and the mean must stay within the measured mean drop (a measured gain counts as none)
plus ``MARGIN`` standard errors (the measured standard deviation over ``sqrt(len(SEEDS))``). If
runs scatter as measured, a correct build fails about once in 4,000 runs per setting, and a
setting whose drop grows by 2 points fails 999 times in 1,000.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ringtrain as rt
from _training import DigitsNet, same_on_every_rank
from ringtrain.bench.converge_tasks import Task, build
from ringtrain.testing import spawn

STEPS, EVAL_EVERY, EVAL_LAST = 320, 8, 160
SETTINGS: dict[str, dict[str, Any]] = {
    "sync": {},
    # The outer settings given, as the docstring says: left out, the defaults would measure the
    # link (engine/local_defaults.py) and the test's exchange would depend on the machine's load.
    "local-8": {"sync_every": 8, "outer_compression": "fp16", "outer_overlap": False},
    "local-8-int4": {"sync_every": 8, "outer_compression": "int4", "outer_overlap": False},
    "local-8-int4-overlap": {"sync_every": 8, "outer_compression": "int4", "outer_overlap": True},
    "local-8-int4-overlap-4-fragments": {
        "sync_every": 8,
        "outer_compression": "int4",
        "outer_overlap": True,
        "outer_fragments": 4,
    },
}
# Measured (torch 2.13 CPU, AMD EPYC; 36 runs: seeds 0-11 under ATEN_CPU_CAPABILITY default,
# avx2 and avx512, whose own means agree within 0.15 points): each setting's drop from
# synchronous in accuracy points, mean and standard deviation over the runs. Synchronous
# averaged 98.18%. The bounds this gives: 0.73, 0.65, 1.22 and 1.03 points.
MEASURED = {
    "local-8": (-0.04, 0.36),
    "local-8-int4": (-0.02, 0.32),
    "local-8-int4-overlap": (0.31, 0.45),
    "local-8-int4-overlap-4-fragments": (0.24, 0.39),
}
SEEDS = (0, 1, 2)
MARGIN = 3.5  # standard errors: a false failure about once in 4,000 runs per setting
BOUND = {  # the mean drop over SEEDS allowed, as a fraction
    name: (max(mean, 0.0) + MARGIN * sd / math.sqrt(len(SEEDS))) / 100
    for name, (mean, sd) in MEASURED.items()
}


def _accuracy(task: Task, model: torch.nn.Module) -> float:
    """Held-out accuracy, each rank scoring its share of the images (every rank holds the same
    weights where this is called), so an evaluation costs each rank half of one."""
    r, n = rt.rank(), rt.size()
    with torch.no_grad():
        right = (model(task.test_x[r::n]).argmax(1) == task.test_y[r::n]).sum().reshape(1)
    return float(rt.allreduce(right, op=rt.Sum, name="held-out")) / len(task.test_y)


def _run(seed: int) -> dict[str, tuple[float, bool]]:
    task = build("digits", None, 0, 64)
    r, n = rt.rank(), rt.size()
    mine = torch.arange(r, len(task.train_x), n)
    out = {}
    for name, extra in SETTINGS.items():
        torch.manual_seed(seed)
        model = DigitsNet()
        opt = rt.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-3), model.named_parameters(), **extra
        )
        local = getattr(opt, "local_update", None)
        late = local.delay if local is not None and local.overlap else 0
        agreed = local.anchored if late else contextlib.nullcontext  # the weights ranks share
        gen = torch.Generator().manual_seed(1000 * seed + r)
        accs = []
        for step in range(1, STEPS + 1):
            batch = mine[torch.randint(len(mine), (32,), generator=gen)]
            opt.zero_grad()
            F.cross_entropy(model(task.train_x[batch]), task.train_y[batch]).backward()
            opt.step()
            if step > STEPS - EVAL_LAST and (step - late) % EVAL_EVERY == 0:
                with agreed():
                    accs.append(_accuracy(task, model))
        with agreed():
            out[name] = (sum(accs) / len(accs), same_on_every_rank(model))
        if late:
            # The last round's exchange is still in flight: let it end before the next setting's
            # optimizer uses the engine's group (two threads' collectives on one group at once
            # mismatch; remove_hooks() does not wait for it).
            for frag in local.fragments:
                frag.drop(settle=True)
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
    return out


@pytest.mark.timeout(900)
def test_local_updates_reach_synchronous_accuracy() -> None:
    runs = []
    for seed, capability in zip(SEEDS, spawn.CAPABILITIES):
        world = spawn.capability_world(2, capability) or spawn.world(2)
        kernels = world.run(spawn.cpu_capability, init=False)[0]
        runs.append((seed, kernels, world.run(_run, seed, timeout=540)[0]))
    report = "; ".join(
        f"seed {seed} ({kernels}): " + ", ".join(f"{k} {a:.4f}" for k, (a, _) in results.items())
        for seed, kernels, results in runs
    )
    print(f"digits, {STEPS} steps, held-out accuracy: {report}")
    for seed, _, results in runs:
        assert results["sync"][0] > 0.9, report
        for name, (_, same) in results.items():
            assert same, f"{name}, seed {seed}: ranks differ after an outer step"
    for name, bound in BOUND.items():
        drop = sum(r["sync"][0] - r[name][0] for _, _, r in runs) / len(runs)
        assert drop <= bound, (
            f"{name}: mean drop {drop * 100:.2f} points over {len(runs)} seeds, bound "
            f"{bound * 100:.2f} (measured mean, sd: {MEASURED[name]}); {report}"
        )
