"""Local updates' policy: which outer exchange, which ``sync_every``, and why. Pure functions
of measured figures (no processes, no clock), so every rank that holds the same figures reaches
the same answer, and tests inject the link.

Two decisions (issue 40):

* :func:`outer_settings`: the outer exchange's wire and overlap. Where the exchange of 16-bit
  weights would take more than :data:`SLOW_SHARE` of a round's compute, the link is slow and
  the default becomes the cheapest wire that keeps quality (``int4``, with error feedback) run
  in the background, its average applied ``delay`` inner steps late, the delay fitted to the
  exchange's predicted wire time. A setting the user gave (``outer_compression`` /
  ``outer_overlap`` / ``outer_delay``) always wins, and the prediction uses it.
* :func:`choose_local`: ``H`` from both the exchange's cost per step and what ``H`` costs in
  steps to the target. Published local-update curves (DiLoCo and its successors) show steps to
  a target growing with ``H``; :func:`steps_factor` is that shape, not a fit: each doubling of
  ``H`` beyond :data:`FREE_H` costs :data:`COST_PER_DOUBLING` more steps. The search starts at
  the smallest ``H`` whose (overlapped) exchange fits inside ``H`` inner steps and keeps the
  ``H`` with the least predicted time to target per step of one host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The outer exchange above this share of a round's compute (16-bit weights, not overlapped)
# makes the link "slow": the narrow, overlapped exchange becomes the default.
SLOW_SHARE = 0.05
# Bytes per weight on the wire for each outer codec (int4 packs two weights a byte; its scales
# are a small extra the collectives' overhead term covers).
CODEC_BYTES = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
# The cheapest wire that keeps quality (error feedback carries what rounding drops).
CHEAPEST = "int4"
DEFAULT_CODEC = "fp16"
# Steps to target: free up to FREE_H, then this much more for each doubling of H.
FREE_H = 16
COST_PER_DOUBLING = 0.15
# From 16: with DiLoCo's outer Nesterov (lr 0.7, momentum 0.9) a short round overshoots (bench
# converge --task mlp, 2 ranks, 400 steps: held-out mse 4.45 at H=4 against 1.42 at H=8), and
# the tuned LM and issue 28's quality bounds sit at H of 8 to 16.
SYNC_EVERY_CHOICES = (16, 32, 64, 128, 256, 512)


# The user's (outer_compression, outer_overlap, outer_delay); None: not given, the policy picks.
Given = tuple[str | None, bool | None, int | None]
NOT_GIVEN: Given = (None, None, None)


@dataclass(frozen=True)
class OuterSettings:
    """The outer exchange chosen: wire, overlap, delay (inner steps) and why."""

    compression: str
    overlap: bool
    delay: int
    why: str


@dataclass(frozen=True)
class LocalChoice:
    """``sync_every`` and its outer exchange, with the predicted time to target per step of
    one host (1.0: one host's pace; lower is faster) and why."""

    sync_every: int
    outer: OuterSettings
    predicted_time_per_step: float
    why: str


def exchange_s(numel: int, codec: str, bytes_per_s: float, overhead_s: float) -> float:
    """Predicted seconds of one outer exchange of ``numel`` weights with ``codec``."""
    if codec not in CODEC_BYTES:
        raise ValueError(
            f"outer codec must be one of {', '.join(CODEC_BYTES)}, got {codec!r}\n"
            "HINT: this is a bug in the caller: Config validates outer_compression."
        )
    if not bytes_per_s > 0:
        raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
    return 2 * overhead_s + numel * CODEC_BYTES[codec] / bytes_per_s


def fitting_delay(wire_s: float, compute_s: float, sync_every: int) -> int:
    """Inner steps the overlapped exchange needs to finish behind compute (at least 1, at most
    ``sync_every``)."""
    steps = math.ceil(wire_s / compute_s) if compute_s > 0 else sync_every
    return max(1, min(sync_every, steps))


def outer_settings(
    numel: int,
    sync_every: int,
    compute_s: float,
    bytes_per_s: float,
    overhead_s: float = 0.0,
    compression: str | None = None,
    overlap: bool | None = None,
    delay: int | None = None,
) -> OuterSettings:
    """The outer exchange for local updates every ``sync_every`` steps of ``compute_s`` each,
    over a link of ``bytes_per_s``. ``compression``/``overlap``/``delay``: the user's settings
    (None: not given), which always win."""
    plain = exchange_s(numel, DEFAULT_CODEC, bytes_per_s, overhead_s)
    share = plain / max(sync_every * compute_s, 1e-12)
    slow = share > SLOW_SHARE
    codec = compression if compression is not None else (CHEAPEST if slow else DEFAULT_CODEC)
    over = overlap if overlap is not None else slow
    wire = exchange_s(numel, codec, bytes_per_s, overhead_s)
    lag = delay if delay else fitting_delay(wire, compute_s, sync_every)
    given = [
        name
        for name, value in (("outer_compression", compression), ("outer_overlap", overlap))
        if value is not None
    ]
    head = (
        f"16-bit weights ({numel * 2 / 2**20:.1f} MiB) take ~{plain:.2f} s, {share:.0%} of "
        f"{sync_every} steps' compute: the link is {'slow' if slow else 'fast enough'}"
    )
    if slow and not given:
        tail = f"so {codec} (error feedback) overlapped, applied {lag} steps late (~{wire:.2f} s)"
    else:
        tail = f"{codec}, {'overlapped' if over else 'not overlapped'} (~{wire:.2f} s)"
        if given:
            tail += f", as set ({', '.join(given)})"
    return OuterSettings(codec, over, lag if over else 0, f"{head}; {tail}")


def steps_factor(sync_every: int) -> float:
    """Steps to target with local updates every ``sync_every`` steps, relative to synchronous
    training at the same global batch (a shape from published curves: grows with H)."""
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every!r}")
    return 1.0 + COST_PER_DOUBLING * max(0.0, math.log2(sync_every / FREE_H))


def step_time_s(
    sync_every: int, compute_s: float, outer: OuterSettings, numel: int, bps: float, oh: float
) -> float:
    """Predicted wall seconds per inner step: compute plus the exchange's exposed part."""
    wire = exchange_s(numel, outer.compression, bps, oh)
    hidden = outer.delay * compute_s if outer.overlap else 0.0
    return compute_s + max(0.0, wire - hidden) / sync_every


def choose_local(
    numel: int,
    world_size: int,
    compute_s: float,
    bytes_per_s: float,
    overhead_s: float = 0.0,
    compression: str | None = None,
    overlap: bool | None = None,
    delay: int | None = None,
    choices: tuple[int, ...] = SYNC_EVERY_CHOICES,
) -> LocalChoice:
    """The ``H`` with the least predicted time to target per step of one host, searched from
    the smallest ``H`` whose (overlapped) exchange fits inside ``H`` inner steps. The time to
    target of N ranks at H is ``step_time * steps_factor(H) / N`` of one host's
    ``compute_s`` per step (each rank takes 1/N of the steps at equal samples)."""
    if world_size < 2 or compute_s <= 0:
        raise ValueError(
            f"local updates need world_size >= 2 and compute_s > 0, got {world_size}, {compute_s!r}"
        )

    def option(h: int) -> tuple[float, OuterSettings]:
        outer = outer_settings(
            numel, h, compute_s, bytes_per_s, overhead_s, compression, overlap, delay
        )
        step = step_time_s(h, compute_s, outer, numel, bytes_per_s, overhead_s)
        return step * steps_factor(h) / (world_size * compute_s), outer

    def fits(h: int) -> bool:  # the exchange's wire time within H inner steps' compute
        outer = option(h)[1]
        return exchange_s(numel, outer.compression, bytes_per_s, overhead_s) <= h * compute_s

    start = next((h for h in choices if fits(h)), choices[-1])
    best_h = min((h for h in choices if h >= start), key=lambda h: (option(h)[0], h))
    ratio, outer = option(best_h)
    why = (
        f"local updates every {best_h} steps, outer exchange {outer.compression}, "
        f"{'overlapped (delay ' + str(outer.delay) + ')' if outer.overlap else 'not overlapped'}"
        f": predicted time to target per step {ratio:.2f}x one host's (H costs "
        f"{steps_factor(best_h):.2f}x the steps). {outer.why}."
    )
    return LocalChoice(best_h, outer, ratio, why)
