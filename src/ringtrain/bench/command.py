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
from collections.abc import Callable
from typing import Any

from ringtrain.bench import catalog
from ringtrain.bench.units import fmt_bytes, parse_bytes, parse_sizes
from ringtrain.config import OUTER_COMPRESSIONS
from ringtrain.errors import ConfigError


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


def _span(sizes: tuple[int, ...]) -> str:
    return f"{fmt_bytes(sizes[0])}..{fmt_bytes(sizes[-1])}"


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
    default_sizes = _span(catalog.ALLREDUCE_SIZES)
    _sweep(
        ar,
        catalog.ALLREDUCE_SIZES,
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
    secure_sizes = _span(catalog.SECURE_SIZES)
    _sweep(
        se,
        catalog.SECURE_SIZES,
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
    ck_sizes = ",".join(fmt_bytes(b).replace(" ", "") for b in catalog.CHECKS_SIZES)
    _sweep(
        ck,
        catalog.CHECKS_SIZES,
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
    cpu_sizes = _span(catalog.CPU_SIZES)
    _sweep(
        cu,
        catalog.CPU_SIZES,
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
    cp.add_argument("--model", default="transformer-25m", choices=list(catalog.MODELS))
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
            + "; ".join(f"{name}: {what}" for name, what in catalog.MODELS.items())
        ),
    )
    tr.add_argument("--model", default="transformer-25m", choices=list(catalog.MODELS))
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
        default=",".join(catalog.TRAIN_VARIANTS),
        help=f"comma-separated subset of {','.join(catalog.TRAIN_VARIANTS)}; ringtrain:NAME uses compression "
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
    _mixed_speed_parser(sub)
    _coordinator_parser(sub)


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
    cv.add_argument("--task", default="digits", choices=catalog.CONVERGE_TASKS)
    cv.add_argument(
        "--variants",
        default=",".join(catalog.CONVERGE_DEFAULT_VARIANTS),
        help=f"comma-separated subset of {','.join(catalog.CONVERGE_VARIANTS)}",
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


def _mixed_speed_parser(sub: Any) -> None:
    ms = sub.add_parser(
        "mixed-speed",
        help="one rank slowed: equal shares vs batch_shares='auto' vs the sum of alone-speeds",
        description=(
            'Mixed speed: equal shares vs batch_shares="auto" with one rank slowed, side by '
            "side (bench train's mixed-speed setting)."
        ),
    )
    ms.add_argument("--slow-rank", type=int, default=1, help="the rank slowed (default 1)")
    ms.add_argument(
        "--slow-by",
        default="hog",
        choices=catalog.SLOW_BY,
        help="hog: a busy process on its cores (a core per rank); sleep: it sleeps (any cores); "
        "cgroup: CPU quotas, the slow rank's 1/--slow-factor of the others' (root)",
    )
    ms.add_argument(
        "--cpus",
        type=float,
        default=0.0,
        help="--slow-by cgroup: each rank's CPUs (default: the quotas fill 0.9 of the cores)",
    )
    ms.add_argument(
        "--slow-factor", type=float, default=2.0, help="sleep and cgroup: 1/speed (default 2)"
    )
    ms.add_argument("--global-batch", type=int, default=16384)
    ms.add_argument("--steps", type=int, default=20, help="timed global batches per setting")
    ms.add_argument("--width", type=int, default=512, help="the MLP's hidden width")
    ms.add_argument(
        "--sync-every",
        type=int,
        default=0,
        help="local updates every H steps (shares measured a round at a time); 0: synchronous",
    )
    _common(ms)


def _coordinator_parser(sub: Any) -> None:
    p = sub.add_parser(
        "coordinator",
        help="a negotiation round at N ranks, simulated in one process: gathered vs vector",
        description=(
            "What a negotiation round costs at N ranks, in one process: the real controller of "
            "one rank over a simulated wire, gathered and vector rounds side by side, idle and "
            "carrying cached ops. No ranks are spawned, so -np and the launcher play no part; "
            "the Python times are this process's on whatever else the machine runs (the counts "
            "are exact)."
        ),
    )
    p.add_argument("--ranks", default="8,64,256,1024", help="rank counts, comma separated")
    p.add_argument("--ops", default="0,64", help="cached ops per round, comma separated")
    p.add_argument("--rounds", type=int, default=20, help="rounds per figure (median)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")


def main(args: argparse.Namespace) -> int:
    # Imported here, not above: it imports torch and every benchmark (two seconds), which
    # --help and a refused flag do without.
    from ringtrain.bench import runner

    return runner.main(args)
