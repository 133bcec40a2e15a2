"""``ringtrain bench``'s run, once its flags are parsed (:mod:`.command`): the benchmark's
parameters checked here, not on the ranks; the ranks spawned or joined; the result printed,
saved as JSON and plotted."""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable
from typing import Any

from ringtrain.bench import (
    bad_input,
    checks,
    converge,
    coordinator,
    cpu,
    mixed_speed,
    ranks,
    secure,
)
from ringtrain.bench import checkpoint as ckpt_bench
from ringtrain.bench.allreduce import AllreduceParams
from ringtrain.bench.registry import BENCHMARKS
from ringtrain.bench.report import (
    format_allreduce,
    format_checks,
    format_secure,
    format_train,
    plot_allreduce,
    plot_checks,
    plot_secure,
    plot_train,
    save_json,
)
from ringtrain.bench.train import TrainParams, variant_compression
from ringtrain.config import Config, check_path
from ringtrain.errors import ConfigError


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if args.fusion_threshold_mb is not None:
        if not math.isfinite(args.fusion_threshold_mb):  # int() of it raises, unexplained
            raise ConfigError(
                f"--fusion-threshold-mb {args.fusion_threshold_mb}: give a finite number of "
                "MiB.\nHINT: e.g. 64, or 0 to send every tensor alone."
            )
        settings["fusion_threshold_bytes"] = int(args.fusion_threshold_mb * (1 << 20))
    if args.cycle_time_ms is not None:
        settings["cycle_time_ms"] = args.cycle_time_ms
    return settings


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The command's options, as recorded in the JSON file next to the results."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, tuple))}


def _params(args: argparse.Namespace) -> Any:
    """The benchmark's parameters from its command line; bad values fail here, not on ranks."""
    bad_input.counts(args)
    if args.benchmark == "allreduce":
        return AllreduceParams(
            sizes=tuple(args.sizes),
            repeats=args.repeats,
            iters=args.iters,
            fusion_count=args.fusion_count,
            fusion_each_bytes=args.fusion_size,
            fusion_repeats=args.fusion_repeats,
            dtype=args.dtype,
            link_mbps=args.link_mbps,
            tcp=args.tcp,
            reducescatter=args.reducescatter,
        )
    if args.benchmark == "secure":
        return secure.SecureParams(
            sizes=tuple(args.sizes),
            repeats=args.repeats,
            iters=args.iters,
            link_mbps=args.link_mbps,
            key_file=args.key_file,
        )
    if args.benchmark == "checks":
        return checks.ChecksParams(
            sizes=tuple(args.sizes),
            repeats=args.repeats,
            iters=args.iters,
            step_tensors=args.step_tensors,
            step_each_bytes=args.step_size,
            step_iters=args.step_iters,
        )
    if args.benchmark == "cpu":
        if args.tail_ms < 0 or args.burst_count < 0:
            raise ConfigError(
                f"--tail-ms and --burst-count must be >= 0, got {args.tail_ms} and "
                f"{args.burst_count}"
            )
        if args.plot:
            raise ConfigError("bench cpu draws no plot.\nHINT: use --json for the numbers.")
        return cpu.CpuParams(
            sizes=tuple(args.sizes),
            repeats=args.repeats,
            iters=args.iters,
            tail_s=args.tail_ms / 1e3,
            burst_count=args.burst_count,
            burst_each_bytes=args.burst_size,
        )
    if args.benchmark == "checkpoint":
        if args.rounds < 1 or args.steps < 1:
            raise ConfigError(f"--rounds and --steps must be >= 1, got {args.rounds}, {args.steps}")
        if args.plot:
            raise ConfigError("bench checkpoint draws no plot.\nHINT: use --json for the numbers.")
        if args.dir:
            check_path(f"--dir {args.dir}", args.dir, directory=True)
        return ckpt_bench.CheckpointParams(
            model=args.model,
            rounds=args.rounds,
            steps=args.steps,
            batch_size=args.batch_size,
            shard=not args.whole,
            directory=args.dir,
            writer=args.writer,
        )
    if args.benchmark == "mixed-speed":
        return mixed_speed.params_from(args, bad_input.job_size(args))
    if args.benchmark == "converge":
        return _converge_params(args)
    from ringtrain.compression import resolve

    params = TrainParams(
        model=args.model,
        steps=args.steps,
        warmup=args.warmup,
        block=args.block,
        batch_size=args.batch_size,
        compression=args.compression,
        backward_passes_per_step=args.backward_passes_per_step,
        variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
        lr=args.lr,
        optimizer=args.optimizer,
        seed=args.seed,
        fusion_threshold_mb=args.fusion_threshold_mb,
    )
    # An unknown compression name fails here, not on every rank.
    for name in {args.compression, *(variant_compression(v, "none") for v in params.variants)}:
        resolve(name)
    return params


def _converge_params(args: argparse.Namespace) -> converge.ConvergeParams:
    params = converge.ConvergeParams(
        task=args.task,
        variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()),
        target=args.target,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        sync_every=args.sync_every,
        outer_compression=args.outer_compression,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        outer_delay=args.outer_delay,
        outer_fragments=args.outer_fragments,
        eval_every=args.eval_every,
        seed=args.seed,
        width=args.width,
        slow_rank=args.slow_rank,
        slow_factor=args.slow_factor,
        cpus=args.cpus,
    )
    params.check_size(bad_input.job_size(args))  # here, not on every rank
    return params


# How each benchmark's result is printed and plotted.
_PRESENT: dict[str, tuple[Callable[[Any, bool], str], Callable[[Any, str], None]]] = {
    "allreduce": (format_allreduce, plot_allreduce),
    "secure": (format_secure, plot_secure),
    "checks": (format_checks, plot_checks),
    "cpu": (cpu.format_cpu, lambda res, path: None),  # --plot refused
    "train": (format_train, plot_train),
    "checkpoint": (ckpt_bench.format_checkpoint, lambda res, path: None),  # --plot refused
    "converge": (converge.format_converge, converge.plot_converge),
    "mixed-speed": (mixed_speed.format_mixed_speed, lambda res, path: None),  # --plot refused
}


def _check(args: argparse.Namespace) -> None:
    """What can be checked before any rank starts, as ``ringtrain run`` does: numbers, the
    engine settings (by the Config's own rules) and where the results will be written."""
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout}: give a number of seconds above 0")
    for flag, value in (("-np", args.np), ("--threads", args.threads)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: give 1 or more (or leave it out)")
    Config().replace(**_settings(args))
    bad_input.outputs(args)


def main(args: argparse.Namespace) -> int:
    if args.benchmark == "coordinator":  # one process, no ranks
        return coordinator.main(args)
    _check(args)
    params = _params(args)
    with contextlib.ExitStack() as stack:
        if args.benchmark == "secure" and not ranks.under_launcher():
            # Spawned ranks share this machine: a throwaway key file serves them all.
            params = stack.enter_context(secure.spawned_key_file(params))
        result = ranks.run(
            BENCHMARKS[args.benchmark],
            params,
            np=args.np,
            threads=args.threads,
            settings=_settings(args),
            timeout_s=args.timeout,
        )
    if result is None:  # not rank 0 of a launched job: rank 0 reports
        return 0
    present, plot = _PRESENT[args.benchmark]
    print(present(result, args.markdown), flush=True)
    if args.json:  # first: a plot that fails must not lose the numbers
        save_json(args.json, result, args.benchmark, _options(args))
    if args.plot:
        plot(result, args.plot)
    return 0
