"""Training benchmark: steps/s of ringtrain's DistributedOptimizer vs torch DDP vs no communication.

The three variants train separate copies of the same model (same seed, same synthetic batches) in
the same processes, interleaved in round-robin blocks of steps after a warm-up, so each sees the
same machine load: on a shared machine, running them one after the other would compare the
neighbours' load as much as the code. Every rank starts each block after a barrier, so a variant
never pays for the skew the previous one left behind.

* ``ringtrain``: ``ringtrain.DistributedOptimizer`` around SGD, with ``--compression`` and
  ``--backward-passes-per-step`` passed through. ``ringtrain:NAME`` is the same with
  ``compression=NAME`` (``ringtrain:powersgd``, ``ringtrain:topk``, ``ringtrain:auto``...), so
  one run compares several methods side by side.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the default (Gloo) group, with its
  fp16/bf16 compression hook when ``--compression`` is fp16/bf16 and ``no_sync()`` for
  accumulation, i.e. the nearest DDP equivalent of the ringtrain settings.
* ``nocomm``: the same model and optimizer with no communication at all: the compute floor.

Warm-up: ``warmup`` steps per variant, then more (up to :data:`MAX_EXTRA_WARMUP`) until the
variant is steady: PowerSGD past its uncompressed start steps, ``auto`` settled on its choice
(whose measurement runs in these untimed steps, uninterrupted by other variants, as it needs).

A step is ``backward_passes_per_step`` forward/backward passes and one optimizer step; its time
on the slowest rank is one sample. The share of a step spent communicating (or waiting for it) is
``1 - nocomm / variant``. Limits: ringtrain's background controller thread runs for the whole
benchmark and so costs its (small, idle) share in every variant; synthetic data means input
loading costs nothing here.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ringtrain
from ringtrain.bench import catalog
from ringtrain.bench.models import Batch, Preset, count_parameters, get_preset
from ringtrain.bench.registry import register
from ringtrain.bench.stats import Summary, load_average, machine_info
from ringtrain.bench.timing import settle
from ringtrain.compression.policy import AutoCompression
from ringtrain.errors import ConfigError

VARIANTS = catalog.TRAIN_VARIANTS
# Untimed steps a variant may take beyond --warmup to become steady (see the module docstring).
MAX_EXTRA_WARMUP = 60
# ``ringtrain...@KEY=VALUE`` sets a DistributedOptimizer knob for that variant alone, so bucket
# settings can be compared in one run: KEY -> (argument, unit of VALUE in the argument's terms).
ENGINE_OPTIONS = {"fusion": ("fusion_threshold_bytes", 1 << 20), "cycle": ("cycle_time_ms", 1)}
# ``@link=fast|slow`` pins the link class; ``@repro=0`` lets timing cut buckets (not reproducible);
# ``@shard=1`` shards the optimizer step (ZeRO stage 1, ringtrain.engine.sharded).
ENGINE_CHOICES: dict[str, tuple[str, dict[str, Any]]] = {
    "link": ("link_class", {"fast": "fast", "slow": "slow"}),
    "repro": ("reproducible", {"0": False, "1": True}),
    "shard": ("shard_optimizer", {"0": False, "1": True}),
    # ``@scatter=1`` (with ``@shard=1``): gradients reduce-scattered, not allreduced.
    "scatter": ("reduce_scatter", {"0": False, "1": True}),
    # ``@overlap=1``: cross-iteration overlap (step() returns at once, the forward waits per
    # module); its pending updates end at each block's last step, inside that step's time.
    "overlap": ("overlap", {"0": False, "1": True}),
}
# ``@whole=1``: the wrapped optimizer steps whole after the last bucket instead of bucket by
# bucket as each one is reduced (a step hook forces that, as it does for a user's hook).
BENCH_CHOICES = {"whole": {"0": False, "1": True}}
# --optimizer: what every variant trains with (its own instance per variant).
OPTIMIZERS = ("sgd", "momentum", "adam")
# DDP has built-in comm hooks for these; other compressors have no DDP twin.
_DDP_HOOKS = ("fp16", "bf16")


@dataclass(frozen=True)
class TrainParams:
    model: str = "transformer-25m"
    steps: int = 30  # timed steps per variant
    warmup: int = 3  # untimed steps per variant before the first block
    block: int = 5  # steps per variant per round-robin turn
    batch_size: int | None = None  # per rank and backward pass; None = the preset's default
    compression: str = "none"
    backward_passes_per_step: int = 1
    variants: tuple[str, ...] = VARIANTS
    lr: float = 1e-4
    seed: int = 0
    optimizer: str = "sgd"  # sgd, momentum (SGD with momentum 0.9) or adam
    # Recorded for the report; applied through ringtrain.init settings by the caller.
    fusion_threshold_mb: float | None = None

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if not _known_variant(v)]
        if bad or not self.variants or len(set(self.variants)) != len(self.variants):
            raise ConfigError(
                f"unknown, repeated or no variants in {list(self.variants)}.\n"
                f"HINT: choose from {', '.join(VARIANTS)}, comma separated; "
                "ringtrain:NAME uses compression NAME (ringtrain:powersgd,ringtrain:topk); "
                "ringtrain@fusion=MiB, @cycle=MS, @link=fast|slow, @repro=0|1, @shard=0|1, "
                "@scatter=0|1, @overlap=0|1 and @whole=0|1 set those engine knobs for one variant "
                "(ringtrain@repro=0@cycle=1000)."
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        for name in ("steps", "block", "backward_passes_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0 < self.lr < math.inf:  # NaN too: every variant would train to NaN alike
            raise ConfigError(
                f"--lr must be a finite number above 0, got {self.lr}\n"
                "HINT: leave it out for 1e-4, the rate the presets are timed with."
            )


def _known_variant(name: str) -> bool:
    head, *options = name.split("@")
    base, sep, compression = head.partition(":")
    if base not in VARIANTS or (sep and not (base == "ringtrain" and compression)):
        return False
    if options and base != "ringtrain":
        return False
    try:
        engine_options(name)
    except ValueError:
        return False
    return True


def variant_compression(name: str, default: str) -> str:
    """The compression a ringtrain variant uses: NAME of ``ringtrain:NAME``, else ``default``."""
    return name.split("@")[0].partition(":")[2] or default


def engine_options(name: str) -> dict[str, Any]:
    """The DistributedOptimizer arguments of a variant's ``@KEY=VALUE`` suffixes (ValueError if
    one is malformed): ``ringtrain@fusion=25@cycle=1000`` gives 25 MiB buckets cut by size."""
    kwargs: dict[str, Any] = {}
    for option in name.split("@")[1:]:
        key, _, value = option.partition("=")
        if key in BENCH_CHOICES:
            if value not in BENCH_CHOICES[key]:
                raise ValueError(
                    f"{key} must be one of {', '.join(BENCH_CHOICES[key])} in {name!r}"
                )
            continue  # not an engine argument: _make_variant applies it
        if key in ENGINE_CHOICES:
            arg, choices = ENGINE_CHOICES[key]
            if value not in choices:
                raise ValueError(f"{key} must be one of {', '.join(choices)} in {name!r}")
            kwargs[arg] = choices[value]
            continue
        if key not in ENGINE_OPTIONS:
            raise ValueError(f"unknown engine option {key!r} in {name!r}")
        arg, unit = ENGINE_OPTIONS[key]
        number = float(value) * unit
        least = 0.0 if key == "fusion" else 1e-9  # fusion=0: every tensor alone; cycle > 0
        if not least <= number < float("inf"):
            raise ValueError(f"{key} out of range in {name!r}")
        kwargs[arg] = int(number) if arg == "fusion_threshold_bytes" else number
    return kwargs


@dataclass
class VariantResult:
    variant: str
    step_time: Summary  # seconds per step, slowest rank
    steps_per_s: float
    samples_per_s: float  # over all ranks
    vs_ddp: float | None = None  # steps/s relative to ddp
    # The same ratio round by round (this variant's block against ddp's block of the same round,
    # medians): pairs them under the same load, so its spread is the ratio's own.
    paired_vs_ddp: Summary | None = None
    vs_nocomm: float | None = None  # steps/s relative to nocomm
    comm_fraction: float | None = None  # 1 - nocomm step time / this step time
    warmup_steps: int = 0  # untimed steps taken, --warmup plus what it took to become steady
    chosen: str = ""  # compression="auto": what it settled on
    state_bytes: int = 0  # optimizer state tensors held per rank (the largest rank's)
    # CPU seconds per timed step, every thread of every rank summed (Gloo's and the engine's
    # included): what load on a shared machine does not inflate, unlike the step time.
    cpu_per_step: float = 0.0
    cpu_vs_ddp: float | None = None  # this CPU per step over ddp's (lower is less work)


@dataclass
class TrainResult:
    world_size: int
    params: TrainParams
    model: str
    description: str
    parameters: int
    gradient_bytes: int
    batch_size: int
    samples_per_step: int  # over all ranks
    ddp_compression: str
    variants: list[VariantResult] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    # Resident memory of the largest rank: before the model was built, and the peak of the whole
    # run (ru_maxrss). The peak is one variant's only when the run has one variant.
    base_rss_bytes: int = 0
    peak_rss_bytes: int = 0


class _Variant:
    def __init__(
        self,
        name: str,
        step: Callable[[], None],
        steady: Callable[[int], bool] = lambda steps: True,
        chosen: Callable[[], str] = lambda: "",
        state_bytes: Callable[[], int] = lambda: 0,
        drain: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self.step = step
        self.state_bytes = state_bytes
        # Ends what a step left running (overlap's pending updates) before another variant runs.
        self.drain = drain
        # steady(steps taken) must answer alike on every rank: warm-up ends on it.
        self.steady = steady
        self.chosen = chosen
        self.samples: list[float] = []
        self.cpu_s = 0.0  # this rank's process CPU over the timed steps
        self.warmup_steps = 0


def _make_variant(
    name: str, model: nn.Module, preset: Preset, batches: list[Batch], params: TrainParams
) -> _Variant:
    k = params.backward_passes_per_step
    base_opt = _optimizer(params, model)
    scale = 1.0 / k  # the mean over k micro-batches, as one k-times batch would give

    def passes(net: nn.Module, quiet: Callable[[], Any] = contextlib.nullcontext) -> None:
        # ``quiet`` wraps every pass but the last (DDP's no_sync): communicate once per step.
        for i, (x, y) in enumerate(batches):
            with quiet() if i < k - 1 else contextlib.nullcontext():
                (preset.loss(net(x), y) * scale).backward()

    if name == "nocomm":

        def step() -> None:
            passes(model)
            base_opt.step()
            base_opt.zero_grad(set_to_none=True)

        return _Variant(name, step, state_bytes=lambda: _state_bytes(base_opt))
    if name.startswith("ringtrain"):
        if "@whole=1" in name:
            base_opt.register_step_post_hook(lambda *_: None)
        opt = ringtrain.DistributedOptimizer(
            base_opt,
            named_parameters=model.named_parameters(),
            compression=variant_compression(name, params.compression),
            backward_passes_per_step=k,
            **engine_options(name),
        )

        def rt_step() -> None:
            passes(model)
            opt.step()
            opt.zero_grad(set_to_none=True)

        # Overlap: synchronize() right after step() only waits for the pending updates.
        drain = opt.synchronize if opt.overlap else (lambda: None)
        return _Variant(
            name, rt_step, *_steadiness(opt), state_bytes=lambda: opt.state_bytes, drain=drain
        )
    ddp = nn.parallel.DistributedDataParallel(model)
    if params.compression in _DDP_HOOKS:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = getattr(default_hooks, f"{params.compression}_compress_hook")
        ddp.register_comm_hook(None, hook)

    def ddp_step() -> None:
        passes(ddp, ddp.no_sync)
        base_opt.step()
        base_opt.zero_grad(set_to_none=True)

    return _Variant(name, ddp_step, state_bytes=lambda: _state_bytes(base_opt))


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def _rss_bytes() -> tuple[int, int]:
    """(current, peak) resident memory of this process."""
    import resource

    current = 0
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) * 1024
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _optimizer(params: TrainParams, model: nn.Module) -> torch.optim.Optimizer:
    if params.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=params.lr)
    momentum = 0.9 if params.optimizer == "momentum" else 0.0
    return torch.optim.SGD(model.parameters(), lr=params.lr, momentum=momentum)


def _steadiness(
    opt: ringtrain.DistributedOptimizer,
) -> tuple[Callable[[int], bool], Callable[[], str]]:
    """When a ringtrain variant is steady, and what ``auto`` chose. Every rank answers alike:
    PowerSGD's start is a step count, and auto settles at the same step everywhere."""
    comp = opt.compression
    if isinstance(comp, AutoCompression):
        if ringtrain.size() == 1:  # nothing to measure: auto stays uncompressed
            return (lambda steps: True), (lambda: "none")
        # Settled means measured, tried (PowerSGD past its start steps) and kept or dropped.
        return (lambda steps: comp.settled), (lambda: comp.choice or "")
    start = int(getattr(comp, "start_iter", 0))
    return (lambda steps: steps > start), (lambda: "")


@register("train")
def bench_train(params: TrainParams) -> TrainResult:
    """Runs on every rank after ``ringtrain.init()``; every rank returns the same result."""
    preset = get_preset(params.model)
    n = ringtrain.size()
    machine = machine_info()
    batch_size = params.batch_size or preset.default_batch_size
    base_rss = _rss_bytes()[0]
    torch.manual_seed(params.seed)
    template = preset.build()
    g = torch.Generator().manual_seed(params.seed + 1000 * ringtrain.rank())
    batches = [preset.make_batch(batch_size, g) for _ in range(params.backward_passes_per_step)]
    variants = [
        _make_variant(v, copy.deepcopy(template), preset, batches, params) for v in params.variants
    ]
    nparams = count_parameters(template)
    grad_bytes = sum(p.numel() * p.element_size() for p in template.parameters())
    del template

    for v in variants:
        while v.warmup_steps < params.warmup or (
            not v.steady(v.warmup_steps) and v.warmup_steps < params.warmup + MAX_EXTRA_WARMUP
        ):
            v.step()
            v.warmup_steps += 1
        v.drain()
    rounds = -(-params.steps // params.block)
    for r in range(rounds):
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            todo = min(params.block, params.steps - len(v.samples))
            settle()
            dist.barrier()
            c0 = time.process_time()
            for i in range(todo):
                t0 = time.perf_counter()
                v.step()
                if i == todo - 1:
                    v.drain()  # the block's last step pays for what it left running
                v.samples.append(time.perf_counter() - t0)
            v.cpu_s += time.process_time() - c0

    # The slowest rank's time per step: one small allreduce after all timing is done.
    memory = [base_rss, _rss_bytes()[1], *(v.state_bytes() for v in variants)]
    flat = torch.tensor([s for v in variants for s in v.samples] + memory, dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    per = flat.tolist()
    base_rss, peak_rss, *state = (int(x) for x in per[len(per) - len(memory) :])
    cpu = torch.tensor([v.cpu_s for v in variants], dtype=torch.float64)
    dist.all_reduce(cpu)  # summed over ranks
    samples_per_step = batch_size * params.backward_passes_per_step * n
    result = TrainResult(
        n,
        params,
        preset.name,
        preset.description,
        nparams,
        grad_bytes,
        batch_size,
        samples_per_step,
        params.compression if params.compression in _DDP_HOOKS else "none",
        environment=machine,
        base_rss_bytes=base_rss,
        peak_rss_bytes=peak_rss,
    )
    for i, v in enumerate(variants):
        mine = per[i * params.steps : (i + 1) * params.steps]
        s = Summary.of(mine)
        result.variants.append(
            VariantResult(
                v.name,
                s,
                1.0 / s.median,
                samples_per_step / s.median,
                warmup_steps=v.warmup_steps,
                chosen=v.chosen(),
                state_bytes=state[i],
                cpu_per_step=float(cpu[i]) / params.steps,
            )
        )
    _pair_with_ddp(result.variants, per, params)
    _add_ratios(result.variants)
    result.environment["load_after"] = load_average()
    return result


def _pair_with_ddp(results: list[VariantResult], per: list[float], params: TrainParams) -> None:
    """Each variant's speed over DDP's round by round (blocks of the same round, under the same
    load), and its CPU per step over DDP's; nothing without a ddp variant."""
    names = [r.variant for r in results]
    if "ddp" not in names:
        return
    k = names.index("ddp")
    ddp_blocks = _blocks(per[k * params.steps : (k + 1) * params.steps], params.block)
    ddp_cpu = results[k].cpu_per_step
    for i, vr in enumerate(results):
        mine = _blocks(per[i * params.steps : (i + 1) * params.steps], params.block)
        vr.paired_vs_ddp = Summary.of([d / m for d, m in zip(ddp_blocks, mine) if m > 0])
        vr.cpu_vs_ddp = vr.cpu_per_step / ddp_cpu if ddp_cpu > 0 else None


def _blocks(samples: list[float], block: int) -> list[float]:
    """The median of each round's block of steps (every variant runs one block per round)."""
    return [statistics.median(samples[j : j + block]) for j in range(0, len(samples), block)]


def _add_ratios(results: list[VariantResult]) -> None:
    by_name = {r.variant: r for r in results}
    ddp, nocomm = by_name.get("ddp"), by_name.get("nocomm")
    for r in results:
        if ddp is not None:
            r.vs_ddp = r.steps_per_s / ddp.steps_per_s
        if nocomm is not None:
            r.vs_nocomm = r.steps_per_s / nocomm.steps_per_s
            r.comm_fraction = 1.0 - nocomm.step_time.median / r.step_time.median
