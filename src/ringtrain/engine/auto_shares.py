"""``batch_shares="auto"``: shares of the global batch in proportion to each rank's measured rate.

Each rank times its own work per step as the straggler report does: from the end of one
``synchronize()`` to the start of the next (forward, backward, loading its batch; not the wait
for the others). Over ``MEASURE_STEPS`` steps (after ``WARMUP_STEPS``) its median gives its
rate, ``share / seconds`` (samples per second in the shares' unit), and one small allreduce at
that step boundary gives every rank every rate, so every rank sets the same shares at the same
step: :func:`shares_for` (integers out of ``RESOLUTION``, so the weights are exact fractions and
the same everywhere). Then it keeps measuring; the shares change again only when a rank's rate
moved by more than ``MARGIN`` (20%) from the rate they were set from.

The split depends on timing: two runs may choose different shares, so their weights differ.
An explicit list is reproducible bit for bit; ``"auto"`` is the user's opt-in to a timing-
dependent split.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ringtrain.transport import group_ops

log = logging.getLogger("ringtrain")

WARMUP_STEPS = 2
MEASURE_STEPS = 5
MARGIN = 0.2
RESOLUTION = 1000


def shares_for(rates: Sequence[float]) -> tuple[int, ...]:
    """Integer shares (about ``RESOLUTION`` in all, each at least 1) in proportion to ``rates``."""
    whole = sum(rates)
    return tuple(max(1, round(RESOLUTION * r / whole)) for r in rates)


def moved(rates: Sequence[float], before: Sequence[float] | None, margin: float = MARGIN) -> bool:
    """Whether the shares must be set again: never set, or a rate moved by more than ``margin``
    (as a fraction of the rate they were set from)."""
    if before is None or len(before) != len(rates):
        return True
    return any(abs(r - b) > margin * b for r, b in zip(rates, before))


def describe(shares: Sequence[int], rates: Sequence[float]) -> str:
    """The one log line: who gets how much of each global batch, and why (each rank's speed
    relative to the fastest's: the rates are in the shares' unit per second, not samples)."""
    whole, fastest = sum(shares), max(rates)
    parts = ", ".join(
        f"rank {r} {s / whole:.1%} (speed {rate / fastest:.2f})"
        for r, (s, rate) in enumerate(zip(shares, rates))
    )
    return (
        f"ringtrain batch_shares=auto: shares {list(shares)} of each global batch: {parts}, "
        f"from each rank's measured rate (median of {MEASURE_STEPS} steps); measured again "
        f"when a rate moves by more than {MARGIN:.0%}"
    )


class AutoShares:
    """The measurement state of one optimizer's ``batch_shares="auto"``."""

    def __init__(
        self,
        size: int,
        rank: int,
        agree: Callable[[list[float]], list[float]],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``agree(values)``: every rank's ``values`` summed (identical on every rank)."""
        self.size, self.rank = size, rank
        self.shares: tuple[int, ...] = (1,) * size
        self._agree, self._clock = agree, clock
        self._set_from: list[float] | None = None
        self._seconds: list[float] = []
        self._skip = WARMUP_STEPS
        self._last_end = 0.0

    def observe(self, start: float, end: float) -> tuple[int, ...] | None:
        """One ``synchronize()`` from ``start`` to ``end``; new shares when they change (the
        same on every rank, at the same step). Collective every ``MEASURE_STEPS`` steps."""
        previous, self._last_end = self._last_end, end
        if previous == 0.0:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        self._seconds.append(max(start - previous, 1e-9))
        if len(self._seconds) < MEASURE_STEPS:
            return None
        mine = self.shares[self.rank] / statistics.median(self._seconds)
        self._seconds = []
        vector = [0.0] * self.size
        vector[self.rank] = mine
        rates = self._agree(vector)
        self._last_end = self._clock()  # the agreement is not this rank's work
        if not moved(rates, self._set_from):
            return None
        first, self._set_from = self._set_from is None, rates
        new = shares_for(rates)
        if self.rank == 0:  # the first choice shown by default (as auto compression's), then INFO
            log.log(logging.WARNING if first else logging.INFO, "%s", describe(new, rates))
        if new == self.shares:
            return None
        self.shares = new
        return new


def agree_on(group: object) -> Callable[[list[float]], list[float]]:
    """Every rank's values summed over ``group`` (float64: the same bits on every rank)."""

    def agree(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        group_ops.allreduce(t, group, op="sum")
        return [float(v) for v in t.tolist()]

    return agree
