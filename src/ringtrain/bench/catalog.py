"""What ``ringtrain bench`` offers on its command line: each benchmark's default sizes, the model
presets' names and descriptions, variants, tasks. The benchmarks' modules take them from here.

No torch here: the command builds its flags and its ``--help`` from this module alone, and
imports the benchmarks (and torch, two seconds) only to run one.
"""

from __future__ import annotations

from ringtrain.bench.units import KiB, MiB

ALLREDUCE_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
SECURE_SIZES = (64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
CHECKS_SIZES = (4 * KiB, MiB)
CPU_SIZES = (64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB)

# ``bench train`` and ``bench checkpoint``'s --model (:mod:`.models` builds them).
MODELS = {
    "mlp-1m": "MLP 1024-640-512-10 on random 1024-d inputs",
    "mlp-10m": "MLP 1024-2048-2048-1536-10 on random 1024-d inputs",
    "cnn-small": "4-stage CNN (32-64-128-128 channels) + 1 hidden FC on random 3x32x32 images",
    "cnn": "4-stage CNN (64-128-256-512 channels) + 1 hidden FC on random 3x32x32 images",
    "transformer-25m": "GPT-like LM: 6 layers, d=512, 8 heads, vocab 6144, seq 64",
    "transformer-100m": "GPT-like LM: 12 layers, d=768, 12 heads, vocab 8192, seq 64",
}
TRAIN_VARIANTS = ("ringtrain", "ddp", "nocomm")

# ``bench converge`` (:mod:`.converge`, :mod:`.converge_tasks`).
CONVERGE_TASKS = ("digits", "lm", "mlp")
CONVERGE_DEFAULT_VARIANTS = (
    "alone",
    "ddp",
    "ringtrain",
    "ringtrain:powersgd",
    "local",
    "local:overlap",
    "local:bare",
    "auto",
    "local:shares",
    "local:overlap:shares",
)
# Not run unless asked for: they need a slow rank (--slow-rank) to differ from local's.
CONVERGE_VARIANTS = (*CONVERGE_DEFAULT_VARIANTS, "local:steps", "local:overlap:steps")

# ``bench mixed-speed --slow-by`` (:mod:`.mixed_speed`).
SLOW_BY = ("hog", "sleep", "cgroup")
