"""What ``ringtrain bench`` checks in its flags before any rank starts, beyond argparse's types:
each bad value gets one clear error here instead of one traceback per rank, or of being taken
silently as 'auto', 'skip' or 'the default'."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os

from ringtrain.bench import ranks
from ringtrain.config import check_path
from ringtrain.errors import ConfigError


def counts(args: argparse.Namespace) -> None:
    """Counts, the batch size, the link rate and the key file."""
    if args.benchmark in ("allreduce", "secure", "checks", "cpu") and args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if args.benchmark == "checks" and (args.step_tensors < 0 or args.step_iters < 1):
        raise ConfigError(
            f"--step-tensors must be >= 0 and --step-iters >= 1, got {args.step_tensors} "
            f"and {args.step_iters}"
        )
    for flag in ("iters", "fusion_count", "fusion_repeats"):
        if getattr(args, flag, 0) < 0:
            name = "--" + flag.replace("_", "-")
            raise ConfigError(f"{name} must be >= 0, got {getattr(args, flag)}")
    if getattr(args, "batch_size", None) is not None and args.batch_size < 1:
        raise ConfigError(
            f"--batch-size must be >= 1, got {args.batch_size}\n"
            "HINT: give the samples per rank, or leave it out for the default."
        )
    link = getattr(args, "link_mbps", None)
    if link is not None and not 0 < link < math.inf:
        raise ConfigError(
            f"--link-mbps {link}: give the link's rate in Mbit/s, above 0.\n"
            "HINT: e.g. --link-mbps 1000 for 1 GbE, or leave it out."
        )
    key = getattr(args, "key_file", "")
    if key and not os.path.isfile(key):  # else every rank fails to open it
        raise ConfigError(
            f"--key-file {key}: not an existing file.\n"
            "HINT: give an existing key file, or leave it out for a throwaway key."
        )


def job_size(args: argparse.Namespace) -> int:
    """How many ranks will run: the launcher's job, or -np spawned here (default 2)."""
    here = ranks.placement()
    return here.size if here.launcher != "single" else args.np or 2


def outputs(args: argparse.Namespace) -> None:
    """--json and --plot can be written, --plot can be drawn, and they are not one file (the
    JSON would overwrite the plot)."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_path(f"{flag} {path}", path)
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # else fails after the run
        raise ConfigError(
            "--plot needs matplotlib, which is not installed.\n"
            "HINT: pip install 'ringtrain[bench]', or leave --plot out."
        )
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        raise ConfigError(
            f"--json and --plot are the same file, {args.json}.\n"
            "HINT: give them different paths, e.g. out.json and out.png."
        )
