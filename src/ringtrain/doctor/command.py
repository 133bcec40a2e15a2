"""``ringtrain doctor [-H hosts]``: flags -> :class:`DoctorOptions` -> a report and an exit code.

Exit codes: 0 when nothing found would stop a job (warnings are printed), 1 when something
would (an unreachable host, no common network, torch missing or of different versions, a failed
link test or allreduce), 2 for bad flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ringtrain.config import Bounds
from ringtrain.doctor import advice, checkup, report, wire
from ringtrain.doctor.gather import Reach
from ringtrain.errors import ConfigError
from ringtrain.launch.hosts import Host, parse_hostfile, parse_hosts
from ringtrain.launch.ssh_flags import add_ssh_arguments, check_ssh_files, ssh_options

MiB = 1024 * 1024
# Every number the doctor takes, checked before any host is probed: dest -> (flag, rule).
NUMBERS: dict[str, tuple[str, Bounds]] = {
    "np": ("-np", Bounds(1, whole=True, unit="ranks", hint="e.g. -np 8 for 8 ranks.")),
    "link_seconds": (
        "--link-seconds",
        Bounds(0, above=True, unit="seconds", hint="1 streams for a second per host pair."),
    ),
    "allreduce_budget": (
        "--allreduce-budget",
        Bounds(0, above=True, unit="seconds", hint="6 gives the allreduce sizes 6 s in all."),
    ),
    "start_timeout": (
        "--start-timeout",
        Bounds(0, above=True, unit="seconds", hint="60 gives the agents a minute to answer."),
    ),
    "model_params": ("--model-params", Bounds(0, above=True, unit="parameters", hint="e.g. 25e6")),
    "model_mb": ("--model-mb", Bounds(0, above=True, unit="MiB", hint="e.g. 100")),
    "step_time": ("--step-time", Bounds(0, above=True, unit="seconds", hint="e.g. 0.2")),
    "target_efficiency": (
        "--target-efficiency",
        Bounds(0, above=True, high=1, hint="0.9 aims for 90% scaling efficiency."),
    ),
    "fusion_threshold_mb": (
        "--fusion-threshold-mb",
        Bounds(0, unit="MiB", hint="the job's own value (ringtrain run --fusion-threshold-mb)."),
    ),
}


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return wire.parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _number(group: Any, flag: str, default: float, metavar: str, what: str) -> None:
    """A float option whose help states its default, taken from the default itself."""
    group.add_argument(
        flag, type=float, default=default, metavar=metavar, help=f"{what} (default {default:g})"
    )


def configure(p: argparse.ArgumentParser) -> None:
    p.usage = "ringtrain doctor [-H HOSTS | --hostfile FILE] [-np N] [options]"
    p.description = (
        "Pre-flight check of the hosts of a job: software, cores, network, links, allreduce "
        "speed and rank placement; with --model-params/--model-mb and --step-time, a predicted "
        "step time and recommended settings. Exits 1 when something would stop a job."
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="hosts and slots: a:4,b:4 (default: this machine)")
    where.add_argument("--hostfile", help="file with one 'host slots=N' per line")
    p.add_argument("-np", "--num-proc", dest="np", type=int, help="ranks to place (default: slots)")
    p.add_argument("--json", action="store_true", help="print one JSON document for tools")
    p.add_argument(
        "--network-interface",
        default="",
        metavar="VALUE",
        help="interface for job traffic, as for ringtrain run (NAME, HOST=NAME,..., or a CIDR)",
    )
    tests = p.add_argument_group("tests")
    tests.add_argument("--no-links", dest="links", action="store_false", help="skip link tests")
    _number(tests, "--link-seconds", 1.0, "S", "seconds of streaming per host pair")
    tests.add_argument(
        "--no-allreduce", dest="allreduce", action="store_false", help="skip the allreduce job"
    )
    tests.add_argument(
        "--allreduce-sizes",
        type=_sizes,
        default=checkup.DEFAULT_SIZES,
        metavar="SIZES",
        help="allreduce message sizes (default 64K,1M,8M); large ones stop early on slow links",
    )
    _number(tests, "--allreduce-budget", 6.0, "S", "seconds for the allreduce sizes together")
    _number(tests, "--start-timeout", 60.0, "S", "seconds for the allreduce job's agents to answer")
    model = p.add_argument_group("prediction")
    size = model.add_mutually_exclusive_group()
    size.add_argument("--model-params", type=float, metavar="N", help="parameters (fp32 gradients)")
    size.add_argument("--model-mb", type=float, metavar="MB", help="gradient MiB per step")
    model.add_argument(
        "--step-time",
        type=float,
        metavar="S",
        help="measured time of one training step on one rank, in seconds",
    )
    _number(
        model,
        "--target-efficiency",
        advice.DEFAULT_TARGET,
        "F",
        "scaling efficiency the advice aims for",
    )
    _number(model, "--fusion-threshold-mb", 64.0, "MIB", "fusion buffer size, as the job will use")
    add_ssh_arguments(p)


def options_from_args(args: argparse.Namespace) -> checkup.DoctorOptions:
    for dest, (flag, bounds) in NUMBERS.items():
        if getattr(args, dest) is not None:
            setattr(args, dest, bounds.check(flag, getattr(args, dest)))
    hosts: list[Host]
    if args.hosts is not None:  # -H "" is an error, not this host (as in ringtrain run)
        hosts = parse_hosts(args.hosts, "-H")
    elif args.hostfile is not None:
        hosts = parse_hostfile(args.hostfile)
    else:
        hosts = [Host("localhost", max(1, args.np or 1))]
    ssh = ssh_options(args)
    check_ssh_files(ssh, any(not h.is_local for h in hosts))
    grad_bytes = None
    if args.model_params is not None:
        grad_bytes = int(args.model_params * 4)
    elif args.model_mb is not None:
        grad_bytes = int(args.model_mb * MiB)
    if (grad_bytes is None) != (args.step_time is None):
        raise ConfigError(
            "a prediction needs both the model size and the step time.\n"
            "HINT: --model-params 25e6 --step-time 0.2 (or --model-mb 100 --step-time 0.2)"
        )
    return checkup.DoctorOptions(
        hosts=tuple(hosts),
        np=args.np,
        hosts_given=args.hosts is not None or args.hostfile is not None,
        reach=Reach(ssh=ssh),
        network_interface=args.network_interface,
        links=args.links,
        link_seconds=args.link_seconds,
        allreduce=args.allreduce,
        sizes=tuple(args.allreduce_sizes),
        allreduce_budget_s=args.allreduce_budget,
        start_timeout_s=args.start_timeout,
        grad_bytes=grad_bytes,
        step_time_s=args.step_time,
        target_efficiency=args.target_efficiency,
        bucket_bytes=int(args.fusion_threshold_mb * MiB) or grad_bytes or MiB,
    )


def main(args: argparse.Namespace) -> int:
    options = options_from_args(args)

    def say(msg: str) -> None:
        if not args.json:
            print(f"ringtrain doctor: {msg}...", file=sys.stderr, flush=True)

    doc: dict[str, Any] = checkup.examine(options, say)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=False, default=str))
    else:
        print(report.render(doc))
    return int(doc["exit_code"])
