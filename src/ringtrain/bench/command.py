"""``ringtrain bench``: run a registered benchmark, print its table, save JSON and a PNG plot.

    ringtrain bench allreduce -np 2 --sizes 4K..64M --json ar.json --plot ar.png
    ringtrain bench train -np 2 --model transformer-25m --steps 30 --json train.json
    ringtrain bench secure -np 2 --sizes 64K..64M --json secure.json
    ringtrain bench checks -np 2 --json checks.json
    ringtrain bench cpu -np 3 --threads 2 --sizes 64K..16M --json cpu.json
    ringtrain bench checkpoint -np 4 --model transformer-25m --json ckpt.json
    ringtrain bench converge -np 2 --task digits --json converge.json --plot converge.png
    ringtrain bench mixed-speed -np 3 --slow-rank 1 --slow-by sleep --json mixed.json
    ringtrain bench coordinator --ranks 8,64,256,1024 --ops 0,64
    ringtrain run -np 2 -H h0:1,h1:1 -- python -m ringtrain.bench train --model cnn
    ringtrain run --secure -H h0:1,h1:1 -- python -m ringtrain.bench secure --link-mbps 1000

Without a launcher the command spawns ``-np`` ranks on this machine; started by one
(``ringtrain run``, torchrun, ...) it runs on the job's ranks and only rank 0 reports.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
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
from ringtrain.bench.allreduce import DEFAULT_SIZES, AllreduceParams
from ringtrain.bench.models import PRESETS
from ringtrain.bench.registry import BENCHMARKS
from ringtrain.bench.report import (
    fmt_bytes,
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
from ringtrain.bench.train import VARIANTS, TrainParams, variant_compression
from ringtrain.config import OUTER_COMPRESSIONS, Config, check_path
from ringtrain.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}
_UNITS |= {"g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """``64K``, ``4MiB``, ``1048576`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"cannot read {text!r} as a size.\nHINT: write e.g. 4096, 64K, 64KiB, 16M or 1G."
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_sizes(text: str) -> tuple[int, ...]:
    """``4K,64K,1M`` (a list) or ``4K..64M`` (x4 steps) or ``4K..64M:2`` (x2 steps)."""
    if ".." not in text:
        sizes = [parse_bytes(s) for s in text.split(",") if s.strip()]
    else:
        span, _, factor_s = text.partition(":")
        lo_s, _, hi_s = span.partition("..")
        lo, hi = parse_bytes(lo_s), parse_bytes(hi_s)
        try:
            factor = int(factor_s or 4)
        except ValueError:
            factor = 0  # refused below, with the range's HINT
        if lo < 1 or hi < lo or factor < 2:
            raise ConfigError(
                f"bad size range {text!r}: need 1 <= low <= high and a factor >= 2.\n"
                "HINT: e.g. --sizes 4K..64M or --sizes 4K..64M:2."
            )
        sizes = []
        s = lo
        while s <= hi:
            sizes.append(s)
            s *= factor
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes {text!r} gives no positive sizes")
    return tuple(sizes)


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse type: its message, not "invalid parse_sizes value"."""

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    typed.__name__ = parse.__name__
    return typed


_size, _sizes = _arg(parse_bytes), _arg(parse_sizes)


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ranks and output")
    g.add_argument(
        "-np",
        "--num-proc",
        dest="np",
        type=int,
        default=None,
        help="ranks to spawn on this machine (default 2); omit under a launcher",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: cores / ranks when spawning here)",
    )
    g.add_argument("--json", metavar="PATH", help="save the results as JSON")
    g.add_argument("--plot", metavar="PATH", help="save a PNG plot of the results")
    g.add_argument("--markdown", action="store_true", help="print tables as Markdown")
    g.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    g.add_argument(
        "--fusion-threshold-mb",
        type=float,
        default=None,
        help="ringtrain's fusion buffer size in MiB (RINGTRAIN_FUSION_THRESHOLD_BYTES)",
    )
    g.add_argument(
        "--cycle-time-ms",
        type=float,
        default=None,
        help="ringtrain's controller cycle time (RINGTRAIN_CYCLE_TIME_MS)",
    )


def _sweep(
    p: argparse.ArgumentParser,
    sizes: tuple[int, ...],
    sizes_help: str,
    repeats_help: str,
    link: bool = True,
) -> None:
    """The message-size sweep's flags, alike for every benchmark that has one."""
    p.add_argument("--sizes", type=_sizes, default=sizes, help=sizes_help)
    p.add_argument("--repeats", type=int, default=5, help=repeats_help)
    p.add_argument("--iters", type=int, default=0, help="ops per sample (default: auto)")
    if link:
        p.add_argument(
            "--link-mbps", type=float, default=None, help="link rate (Mbit/s) to compare against"
        )


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)

    ar = sub.add_parser(
        "allreduce",
        help="bus bandwidth vs message size, ringtrain vs raw torch.distributed; fusion case",
        description=(
            "Allreduce bus bandwidth vs message size for ringtrain.allreduce and raw "
            "torch.distributed.all_reduce, interleaved in the same run, plus a fusion case."
        ),
    )
    default_sizes = f"{fmt_bytes(DEFAULT_SIZES[0])}..{fmt_bytes(DEFAULT_SIZES[-1])}"
    _sweep(
        ar,
        DEFAULT_SIZES,
        f"message sizes: 4K,64K,1M or 4K..64M[:factor] (default {default_sizes} x4)",
        "timed samples per size and impl",
    )
    ar.add_argument("--fusion-count", type=int, default=1024, help="tensors in the fusion case")
    ar.add_argument(
        "--fusion-size", type=_size, default=64 << 10, help="bytes per fusion-case tensor"
    )
    ar.add_argument(
        "--fusion-repeats", type=int, default=3, help="samples of the fusion case (0 skips it)"
    )
    ar.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ar.add_argument(
        "--tcp",
        action="store_true",
        help="also time the enclave data path (a ringtrain_tcp group) beside Gloo",
    )
    ar.add_argument(
        "--reducescatter",
        action="store_true",
        help="also time ringtrain.reducescatter against torch's reduce_scatter_tensor per size",
    )
    _common(ar)

    se = sub.add_parser(
        "secure",
        help="allreduce bus bandwidth: raw Gloo, ringtrain plain and ringtrain secure",
        description=(
            "What secure mode costs: allreduce bus bandwidth vs message size for raw "
            "torch.distributed on Gloo, ringtrain plain, ringtrain secure (sealed) and the sealed "
            "group alone, plain and secure phases alternating in the same processes. Under a "
            "launcher, start the job with `ringtrain run --secure` (or give --key-file)."
        ),
    )
    secure_sizes = f"{fmt_bytes(secure.DEFAULT_SIZES[0])}..{fmt_bytes(secure.DEFAULT_SIZES[-1])}"
    _sweep(
        se,
        secure.DEFAULT_SIZES,
        f"message sizes: 64K,1M or 64K..64M[:factor] (default {secure_sizes} x4)",
        "phases per mode (samples per size)",
    )
    se.add_argument(
        "--key-file",
        default="",
        help="job key for the secure phases (default: the launcher's, or a throwaway one "
        "when ranks are spawned here)",
    )
    _common(se)

    ck = sub.add_parser(
        "checks",
        help="what consistency checks cost: allreduce time with checks on vs off",
        description=(
            "Allreduce time per op with consistency checks (mismatch detection) on and off, "
            "phases alternating in the same processes, for single tensors and a step of many "
            "named tensors; plus the check alone, per collective."
        ),
    )
    ck_sizes = ",".join(fmt_bytes(b).replace(" ", "") for b in checks.DEFAULT_SIZES)
    _sweep(
        ck,
        checks.DEFAULT_SIZES,
        f"single-tensor sizes: 4K,1M or 4K..1M[:factor] (default {ck_sizes})",
        "phases per setting (samples)",
        link=False,
    )
    ck.add_argument(
        "--step-tensors", type=int, default=256, help="named tensors per step (0 skips the step)"
    )
    ck.add_argument("--step-size", type=_size, default=4 << 10, help="bytes per step tensor")
    ck.add_argument("--step-iters", type=int, default=5, help="steps per sample")
    _common(ck)

    cu = sub.add_parser(
        "cpu",
        help="CPU time per allreduce per rank, ringtrain vs raw torch.distributed; a burst",
        description=(
            "CPU time per allreduce per rank (every thread, an idle tail after each sample "
            "included) for ringtrain.allreduce_ and raw torch.distributed.all_reduce, "
            "interleaved in the same processes: a measure that load does not inflate as it "
            "does wall time. Plus a burst of async allreduces against one tensor of its bytes."
        ),
    )
    cpu_sizes = f"{fmt_bytes(cpu.DEFAULT_SIZES[0])}..{fmt_bytes(cpu.DEFAULT_SIZES[-1])}"
    _sweep(
        cu,
        cpu.DEFAULT_SIZES,
        f"message sizes: 64K,1M or 64K..16M[:factor] (default {cpu_sizes} x4)",
        "samples per size and impl",
        link=False,
    )
    cu.add_argument(
        "--tail-ms", type=float, default=100.0, help="idle time measured after each sample"
    )
    cu.add_argument("--burst-count", type=int, default=256, help="async ops per burst (0 skips)")
    cu.add_argument("--burst-size", type=_size, default=64 << 10, help="bytes per burst op")
    _common(cu)

    cp = sub.add_parser(
        "checkpoint",
        help="checkpoints: training blocked per save, step slowdown while a write runs",
        description=(
            "Asynchronous checkpoints of a preset trained with Adam: how long each save blocks "
            "training (the copy to host memory), how long the background write takes, and step "
            "time while it runs vs idle, interleaved in the same processes."
        ),
    )
    cp.add_argument("--model", default="transformer-25m", choices=list(PRESETS))
    cp.add_argument("--rounds", type=int, default=4, help="saves measured")
    cp.add_argument("--steps", type=int, default=6, help="steps after each save, and idle")
    cp.add_argument("--batch-size", type=int, default=None, help="per rank (default: preset's)")
    cp.add_argument("--whole", action="store_true", help="unsharded optimizer (default sharded)")
    cp.add_argument(
        "--writer",
        default="process",
        choices=("process", "thread"),
        help="the background writer: its own process (the default) or a thread of each rank",
    )
    cp.add_argument(
        "--dir",
        default="",
        help="where to save (each run in a new folder inside it; default: a temporary one)",
    )
    _common(cp)

    tr = sub.add_parser(
        "train",
        help="training steps/s: ringtrain DistributedOptimizer vs DDP vs no communication",
        description=(
            "Training throughput of ringtrain's DistributedOptimizer, torch DDP and a "
            "no-communication reference, interleaved in the same processes. Presets: "
            + "; ".join(f"{p.name}: {p.description}" for p in PRESETS.values())
        ),
    )
    tr.add_argument("--model", default="transformer-25m", choices=list(PRESETS))
    tr.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    tr.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    tr.add_argument("--block", type=int, default=5, help="steps per variant per turn")
    tr.add_argument(
        "--batch-size", type=int, default=None, help="per rank and pass (default: the preset's)"
    )
    tr.add_argument(
        "--compression", default="none", help="none, fp16, bf16 or any registered compressor"
    )
    tr.add_argument("--backward-passes-per-step", type=int, default=1)
    tr.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {','.join(VARIANTS)}; ringtrain:NAME uses compression "
        "NAME, e.g. ringtrain,ringtrain:powersgd,ringtrain:topk,ddp,nocomm; a ringtrain variant "
        "may end in @fusion=MiB, @cycle=MS, @link=fast|slow, @repro=0|1, @shard=0|1, "
        "@scatter=0|1 (with @shard=1: gradients reduce-scattered), @overlap=0|1, @whole=0|1 "
        "(the optimizer steps whole after the last bucket) (engine knobs for it alone), e.g. "
        "ringtrain@fusion=25@cycle=1000, ringtrain@shard=1@scatter=1",
    )
    tr.add_argument("--lr", type=float, default=1e-4)
    tr.add_argument(
        "--optimizer",
        default="sgd",
        choices=("sgd", "momentum", "adam"),
        help="what every variant trains with: sgd, momentum (SGD, 0.9) or adam",
    )
    tr.add_argument("--seed", type=int, default=0)
    _common(tr)
    _converge_parser(sub)
    mixed_speed.configure(sub, _common)
    coordinator.configure(sub)


def _converge_parser(sub: Any) -> None:
    cv = sub.add_parser(
        "converge",
        help="wall time to a target quality: DDP, ringtrain, PowerSGD, local updates",
        description=(
            "Time to a target quality (digits: test accuracy; lm: held-out loss of a small "
            "transformer on generated text), for DDP, ringtrain synchronous, PowerSGD and local "
            "updates (sync_every), one after the other from the same seed; with the bytes the "
            "interfaces sent per sample. 'alone' is the one-host reference run inside the same "
            "job (every rank trains alone on the whole data set), under the same load."
        ),
    )
    cv.add_argument("--task", default="digits", choices=converge.TASKS)
    cv.add_argument(
        "--variants",
        default=",".join(converge.DEFAULT_VARIANTS),
        help=f"comma-separated subset of {','.join(converge.VARIANTS)}",
    )
    cv.add_argument(
        "--target", type=float, default=None, help="accuracy (digits, 0.95) or loss (lm)"
    )
    cv.add_argument("--max-steps", type=int, default=3000)
    cv.add_argument("--batch-size", type=int, default=32, help="per rank and step")
    cv.add_argument(
        "--lr", type=float, default=0.0, help="Adam's (the inner one for local); 0: the task's"
    )
    cv.add_argument("--sync-every", type=int, default=16, help="the local variant's H")
    cv.add_argument("--outer-compression", default="int4", choices=OUTER_COMPRESSIONS)
    cv.add_argument("--outer-lr", type=float, default=0.7, help="local: outer Nesterov SGD's lr")
    cv.add_argument("--outer-momentum", type=float, default=0.9, help="local: its momentum")
    cv.add_argument(
        "--outer-delay",
        type=int,
        default=0,
        help="local:overlap: inner steps before the average is applied (0: a quarter round)",
    )
    cv.add_argument(
        "--outer-fragments",
        type=int,
        default=1,
        help="local variants: the parameters in this many fragments, each exchanged at its own "
        "step of the round (streaming DiLoCo)",
    )
    cv.add_argument("--eval-every", type=int, default=4)
    cv.add_argument("--width", type=int, default=64, help="lm: the model width")
    cv.add_argument(
        "--slow-rank",
        type=int,
        default=-1,
        help="this rank runs at 1/--slow-factor of its speed, sleeping (every variant but alone)",
    )
    cv.add_argument("--slow-factor", type=float, default=2.0)
    cv.add_argument(
        "--cpus",
        type=float,
        default=0.0,
        help="each rank's CPUs, a cgroup quota of its own (root; default: no limit)",
    )
    cv.add_argument("--seed", type=int, default=0)
    _common(cv)


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
