"""Mixed speed: equal shares vs ``batch_shares="auto"`` with one rank slowed, side by side.

    ringtrain bench mixed-speed -np 2 --slow-rank 1                  # a CPU hog on its core
    ringtrain bench mixed-speed -np 3 --slow-rank 1 --slow-by sleep  # any number of cores
    ringtrain bench mixed-speed -np 3 --slow-rank 1 --slow-by cgroup # CPUs of its own (root)
    ringtrain run -np 3 -H a:1,b:1,c:1 -- python -m ringtrain.bench mixed-speed

This is ``bench train``'s mixed-speed setting, a benchmark of its own because its comparison
differs: not ringtrain against DDP at one per-rank batch, but one global batch split equally
against split by ``"auto"``, and both against the sum of the ranks' alone-speeds (the most a
job of them could do). One rank is slowed in one of three ways (``--slow-by``):

- ``hog``: a busy process pinned to that rank's cores, which the rank then gets about half of
  (a shared host, a busy neighbour). Each rank needs cores of its own (``-np`` at most the
  cores), else the ranks slow each other and the hog slows more than one of them.
- ``sleep``: after its forward and backward the rank sleeps ``factor - 1`` times their time, so
  it runs at ``1/factor`` of its speed and leaves its cores to the others (a slower host,
  simulated; works however the ranks share the cores).
- ``cgroup``: every rank gets a CPU quota of its own (:mod:`~ringtrain.bench.cpu_limit`),
  ``--cpus`` each and the slow rank ``1/factor`` of that: ranks sharing cores behave as hosts
  of set speeds, the sum of their quotas within the machine's cores (the default quota fills
  nine tenths of them). Needs root.

Every rank first times its own steps alone (no communication), all at once, so they contend for
the machine as in training; then the job trains an MLP for ``steps`` global batches with equal
shares, then with ``"auto"`` (timed after auto has set its shares; the optimizer weighs by the
samples each rank takes). Every rank returns the same result.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import ringtrain as rt
from ringtrain.bench import catalog, cpu_limit
from ringtrain.bench.registry import register
from ringtrain.bench.stats import load_average
from ringtrain.elastic.share_sampler import split_counts
from ringtrain.engine.auto_shares import MEASURE_STEPS, ROUND_PERIODS, WARMUP_STEPS
from ringtrain.errors import ConfigError

SLOW_BY = catalog.SLOW_BY
# The hog: a busy loop on the given cores that ends when its parent (the rank) is gone.
_HOG = (
    "import os, sys\n"
    "os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\n"
    "parent = os.getppid()\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(1 << 20):\n"
    "        pass\n"
)


@dataclass(frozen=True)
class MixedSpeedParams:
    slow_rank: int = 1
    slow_by: str = "hog"
    factor: float = 2.0  # sleep: the slow rank takes factor x its compute time
    global_batch: int = 16384
    steps: int = 20
    width: int = 512
    sync_every: int = 0  # > 0: local updates every this many steps (shares measured a round)
    cpus: float = 0.0  # cgroup: each rank's CPUs (the slow one's: this / factor); 0: a default

    def check(self, size: int | None = None) -> None:
        """Bad values fail here (before ranks start where ``size`` is not known yet)."""
        if self.slow_by not in SLOW_BY:
            raise ConfigError(
                f"--slow-by must be one of {', '.join(SLOW_BY)}, got {self.slow_by!r}"
            )
        if self.cpus < 0:
            raise ConfigError(f"--cpus must be above 0 (or 0 for the default), got {self.cpus}")
        if not self.factor > 1:
            raise ConfigError(f"--slow-factor must be above 1, got {self.factor}")
        if self.steps < 1 or self.width < 1 or self.sync_every < 0:
            raise ConfigError(
                f"--steps and --width must be >= 1 and --sync-every >= 0, got {self.steps}, "
                f"{self.width}, {self.sync_every}"
            )
        if size is not None and not 0 <= self.slow_rank < size:
            raise ConfigError(
                f"--slow-rank {self.slow_rank} is not a rank of this job of {size} ranks.\n"
                f"HINT: give a rank from 0 to {size - 1}."
            )
        if size is not None and self.global_batch < size:
            raise ConfigError(
                f"--global-batch {self.global_batch} gives some of the {size} ranks no sample"
            )


@dataclass(frozen=True)
class MixedSpeedResult:
    params: MixedSpeedParams
    world_size: int
    alone: list[float]  # each rank's samples/s on its own, all ranks at once
    equal: float  # the job's samples/s, equal shares
    auto: float  # the job's samples/s, batch_shares="auto" (after it set its shares)
    shares: list[float]  # auto's shares at the end
    env: dict[str, Any]

    @property
    def auto_over_equal(self) -> float:
        return self.auto / self.equal

    @property
    def auto_over_alone(self) -> float:
        return self.auto / sum(self.alone)


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)
    )


def rank_cpus(p: MixedSpeedParams, size: int, rank: int, cores: int) -> float:
    """``--slow-by cgroup``: this rank's CPUs (by default the quotas fill 0.9 of ``cores``)."""
    fast = p.cpus or 0.9 * cores / (size - 1 + 1 / p.factor)
    return cpu_limit.rank_cpus(fast, p.factor, rank == p.slow_rank)


@contextlib.contextmanager
def _slowed(p: MixedSpeedParams) -> Iterator[None]:
    """The hog beside this rank while the benchmark runs, or (``cgroup``) this rank's CPU
    quota; nothing for ``sleep``."""
    if p.slow_by == "cgroup":
        cpus = rank_cpus(p, rt.size(), rt.rank(), os.cpu_count() or 1)
        with cpu_limit.cpu_limited(cpus, "ringtrain-bench"):
            yield
        return
    if p.slow_by != "hog" or rt.rank() != p.slow_rank:
        yield
        return
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) * rt.size() > (os.cpu_count() or 1):
        raise ConfigError(
            f"--slow-by hog needs cores of its own for each rank, but rank {rt.rank()} runs on "
            f"{len(mine)} of {os.cpu_count()} cores with {rt.size()} ranks.\n"
            "HINT: -np at most the cores, or --slow-by sleep (the slow rank sleeps instead)."
        )
    hog = subprocess.Popen([sys.executable, "-c", _HOG, ",".join(map(str, mine))])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def _work(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, slow: float) -> None:
    """Forward and backward; a rank slowed by sleeping then sleeps ``slow`` x their time."""
    t0 = time.perf_counter()
    F.cross_entropy(model(x), y).backward()
    if slow:
        time.sleep(slow * (time.perf_counter() - t0))


def _alone(p: MixedSpeedParams, slow: float, steps: int) -> float:
    """This rank's samples/s on its own (forward, backward, SGD step) at an equal share."""
    model = _model(p.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = split_counts(p.global_batch, [1.0] * rt.size())[rt.rank()]
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    _work(model, x, y, 0.0)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        _work(model, x, y, slow)
        opt.step()
    return batch * steps / (time.perf_counter() - start)


def _train(p: MixedSpeedParams, shares: str | None, slow: float) -> tuple[float, list[float]]:
    """The job's samples/s over ``steps`` global batches (after auto settles), and the shares."""
    model = _model(p.width)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        batch_shares=shares,
        sync_every=p.sync_every,
    )
    x, y = torch.randn(p.global_batch, 256), torch.randint(0, 10, (p.global_batch,))
    settle = 1 + WARMUP_STEPS + MEASURE_STEPS + 2 if shares == "auto" else 2
    steps = p.steps
    if (
        p.sync_every
    ):  # whole rounds; auto's first shares at the end of round 1 + let pass + measured
        rounds = 2 + ROUND_PERIODS[0] + ROUND_PERIODS[1] if shares == "auto" else 1
        settle = p.sync_every * rounds
        steps = -(-p.steps // p.sync_every) * p.sync_every
    now: tuple[float, ...] = (1.0,) * rt.size()
    start = 0.0
    for step in range(settle + steps):
        if step == settle:
            rt.allreduce(torch.zeros(1), name="bench.mixed.mark")
            start = time.perf_counter()
        now = tuple(opt.batch_shares or now)
        counts = split_counts(p.global_batch, now)
        if shares == "auto":  # weigh by the samples each rank takes of this batch
            opt.set_batch_shares(counts)
        at = sum(counts[: rt.rank()])
        opt.zero_grad()
        _work(model, x[at : at + counts[rt.rank()]], y[at : at + counts[rt.rank()]], slow)
        opt.step()
    rt.allreduce(torch.zeros(1), name="bench.mixed.end")
    return p.global_batch * steps / (time.perf_counter() - start), list(now)


@register("mixed-speed")
def bench_mixed_speed(p: MixedSpeedParams) -> MixedSpeedResult:
    p.check(rt.size())
    slow = p.factor - 1 if p.slow_by == "sleep" and rt.rank() == p.slow_rank else 0.0
    before = load_average()
    with _slowed(p):
        alone = rt.allgather_object(_alone(p, slow, max(3, p.steps // 2)))
        equal, _ = _train(p, None, slow)
        auto, shares = _train(p, "auto", slow)
    env = {"load_before": before, "load_after": load_average(), "cpus": os.cpu_count()}
    return MixedSpeedResult(p, rt.size(), list(alone), equal, auto, shares, env)


def format_mixed_speed(res: MixedSpeedResult, markdown: bool = False) -> str:
    from ringtrain.bench.report import _load, table

    p = res.params
    if p.slow_by == "cgroup":
        quotas = [rank_cpus(p, res.world_size, r, res.env["cpus"]) for r in range(res.world_size)]
        how = (
            f"given 1/{p.factor:g} of the CPUs the others get (cgroup quotas, "
            + ", ".join(f"{q:.2f}" for q in quotas)
            + ")"
        )
    elif p.slow_by == "hog":
        how = "beside a CPU hog on its cores"
    else:
        how = f"sleeping to 1/{p.factor:g}"
    head = (
        f"mixed speed, {res.world_size} ranks, rank {p.slow_rank} {how}; global batch "
        f"{p.global_batch}, {p.steps} timed steps, MLP 256-{p.width}-10{_load(res.env)}"
    )
    if p.sync_every:
        head += f"; local updates every {p.sync_every} steps"
    whole = sum(res.shares)
    rows = [
        ["alone, each rank", ", ".join(f"{a:,.0f}" for a in res.alone), ""],
        ["sum of alone", f"{sum(res.alone):,.0f}", ""],
        ["equal shares", f"{res.equal:,.0f}", f"{res.equal / sum(res.alone):.2f}x the sum"],
        [
            "auto, shares " + ", ".join(f"{s / whole:.0%}" for s in res.shares),
            f"{res.auto:,.0f}",
            f"{res.auto_over_equal:.2f}x equal, {res.auto_over_alone:.2f}x the sum",
        ],
    ]
    return head + "\n" + table(["", "samples/s", "ratio"], rows, markdown)


def params_from(args: argparse.Namespace, size: int | None = None) -> MixedSpeedParams:
    """The flags as parameters, checked (against the job's ``size`` where it is known)."""
    if args.plot:
        raise ConfigError("bench mixed-speed draws no plot.\nHINT: use --json for the numbers.")
    p = MixedSpeedParams(
        slow_rank=args.slow_rank,
        slow_by=args.slow_by,
        factor=args.slow_factor,
        global_batch=args.global_batch,
        steps=args.steps,
        width=args.width,
        sync_every=args.sync_every,
        cpus=args.cpus,
    )
    p.check(size)
    return p
