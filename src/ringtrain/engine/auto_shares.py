"""``batch_shares="auto"``: shares of the global batch in proportion to each rank's measured rate.

Each rank times its own work per step as the straggler report does: from the end of one
``synchronize()`` to the start of the next (forward, backward, loading its batch; not the wait
for the others). Over ``MEASURE_STEPS`` steps (after ``WARMUP_STEPS``) its median gives its
rate, ``share / seconds`` (samples per second in the shares' unit), and one small allreduce at
that step boundary gives every rank every rate, so every rank sets the same shares at the same
step: :func:`shares_for` (integers out of ``RESOLUTION``, so the weights are exact fractions and
the same everywhere).

Hysteresis, so that a busy machine's noise does not move the shares every few steps: shares in
proportion to the rates are taken only when they are predicted to gain more than ``GAIN_MARGIN``
(10%) over the shares in force (:func:`predicted_gain`: the slowest rank's busy time now over
theirs) or the busiest rank's time is more than that over the mean and it would get less
(:func:`calls_for`: a step's fixed time makes a rank with a small share look slow per sample),
and, once shares are set, only when that holds at ``CONFIRM`` (2) measurements in a row
(then from the mean of their rates; a measurement below the margin clears it). The first choice,
from equal shares, takes one measurement. A uniform slowdown of every rank moves nothing: it
changes no rank's share of the work.

With local updates (``sync_every=H``) a measurement is a whole round instead of a step: from the
end of one round's last ``step()`` to the start of the next round's, every inner step of the
round (:data:`ROUND_PERIODS`: one round let pass, each later round a measurement); the outer
average then weighs each rank by its share, as the gradient average does.

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

from ringtrain.runtime.contracts import Group
from ringtrain.transport import group_ops

log = logging.getLogger("ringtrain")

WARMUP_STEPS = 2
MEASURE_STEPS = 5
GAIN_MARGIN = 0.1  # new shares must be predicted to gain more than this over those in force
CONFIRM = 2  # measurements in a row that must agree before shares in force change
RESOLUTION = 1000
# Local updates: one round let pass (the first holds the link probe), then each round measured.
ROUND_PERIODS = (1, 1, "round")


def shares_for(rates: Sequence[float]) -> tuple[int, ...]:
    """Integer shares (about ``RESOLUTION`` in all, each at least 1) in proportion to ``rates``."""
    whole = sum(rates)
    return tuple(max(1, round(RESOLUTION * r / whole)) for r in rates)


def predicted_gain(now: Sequence[float], new: Sequence[float], rates: Sequence[float]) -> float:
    """A step's busy time at shares ``now`` over that at shares ``new``, for ranks working at
    ``rates`` (any unit: rank r takes ``share_r / sum(shares) / rate_r``; the slowest sets the
    step). Above 1: ``new`` is faster."""

    def busy(shares: Sequence[float]) -> float:
        whole = float(sum(shares))
        return max(s / whole / r for s, r in zip(shares, rates))

    return busy(now) / busy(new)


def _busy(now: Sequence[float], rates: Sequence[float]) -> list[float]:
    """Each rank's time per step at shares ``now``, as measured (``share_r / rate_r``)."""
    return [s / r for s, r in zip(now, rates)]


def imbalance(now: Sequence[float], rates: Sequence[float]) -> float:
    """The busiest rank's time per step at shares ``now`` over the mean of every rank's. Above
    1: some ranks wait for it."""
    busy = _busy(now, rates)
    return max(busy) / (sum(busy) / len(busy))


def calls_for(
    now: Sequence[float], new: Sequence[float], rates: Sequence[float], margin: float = GAIN_MARGIN
) -> bool:
    """Whether a measurement at ``rates`` calls for the move from shares ``now`` to ``new``:
    predicted to gain more than ``margin``, or the busiest rank is more than ``margin`` over
    the mean time and ``new`` gives it less of the batch.

    The prediction alone can trap a rank with a small share: it takes each rank's time as
    proportional to its share, but part of a step's time is fixed (the optimizer, the Python
    around the model), so a rank holding 1% of the batch looks slow per sample and the gain of
    giving it more is understated; one noisy measurement could leave it there, the others
    doing all the work. Its idle time shows in the imbalance, which moves it back."""
    if predicted_gain(now, new, rates) > 1.0 + margin:
        return True
    if imbalance(now, rates) <= 1.0 + margin:
        return False
    busy = _busy(now, rates)
    top = busy.index(max(busy))
    return new[top] / float(sum(new)) < now[top] / float(sum(now))


def gains(now: Sequence[float], rates: Sequence[float], margin: float = GAIN_MARGIN) -> bool:
    """Whether shares in proportion to ``rates`` are called for over ``now`` (:func:`calls_for`)."""
    return calls_for(now, shares_for(rates), rates, margin)


def describe(
    shares: Sequence[int],
    rates: Sequence[float],
    before: Sequence[int],
    basis: str = f"median of {MEASURE_STEPS} steps",
    per: str = "step",
) -> str:
    """The one log line: who gets how much of each global batch, and why: each rank's busy
    time per ``per`` at the shares in force, ``before`` (measured: ``share / rate``; a speed per
    sample would make a rank with a small share and a step's fixed time look slower than it
    is); ``basis``: what each rate was measured over."""
    whole = sum(shares)
    parts = ", ".join(f"rank {r} {s / whole:.1%}" for r, s in enumerate(shares))
    busy = ", ".join(f"rank {r} {b * 1e3:.1f} ms" for r, b in enumerate(_busy(before, rates)))
    return (
        f"ringtrain batch_shares=auto: shares {list(shares)} of each global batch: {parts}; "
        f"each rank's busy time per {per} at the shares in force {list(before)} ({basis}): "
        f"{busy}; changed again only when other shares would gain over {GAIN_MARGIN:.0%} at "
        f"{CONFIRM} measurements in a row"
    )


class AutoShares:
    """The measurement state of one optimizer's ``batch_shares="auto"``."""

    def __init__(
        self,
        size: int,
        rank: int,
        agree: Callable[[list[float]], list[float]],
        clock: Callable[[], float] = time.perf_counter,
        periods: tuple[int, int, str] = (WARMUP_STEPS, MEASURE_STEPS, "step"),
        settle: Callable[[], None] | None = None,
    ) -> None:
        """``agree(values)``: every rank's ``values`` summed (identical on every rank).
        ``periods``: how many periods to let pass, how many to measure over, and what
        :meth:`observe` is called at (``"step"``; local updates: ``"round"``, each a whole
        round's work).
        ``settle()``: waits for what a period left in flight (local updates: the outer exchange)
        before the next period's clock starts, as ``agree`` does after a measurement."""
        self.size, self.rank = size, rank
        self.shares: tuple[int, ...] = (1,) * size
        self._agree, self._clock, self._settle = agree, clock, settle
        self._decided = False  # the first choice made (from the equal shares at the start)
        self._pending: list[float] | None = None  # rates of a measurement that asked for a change
        self._seconds: list[float] = []
        self._skip, self._measure, self._per = periods
        self._basis = f"median of {self._measure} {self._per}{'s' * (self._measure != 1)}"
        self._last_end = 0.0
        self._gaps: list[float] = []  # local updates: this round's times between steps
        self._step_end = 0.0

    def inner_step(self, start: float, end: float) -> None:
        """Local updates: an inner ``step()`` from ``start`` to ``end`` (every one, the round's
        last too, before :meth:`observe`). A round's work is the median time between two steps
        times the steps: a collective between steps (a script's loss allreduce) waits for the
        slowest rank, and counted whole it made every rank measure that rank's pace."""
        if self._step_end:
            self._gaps.append(max(start - self._step_end, 1e-9))
        self._step_end = end

    def observe(self, start: float, end: float) -> tuple[int, ...] | None:
        """One ``synchronize()`` (a round's last ``step()``) from ``start`` to ``end``; new shares
        when they change (the same on every rank, at the same step). Collective once a
        measurement is complete."""
        previous, self._last_end = self._last_end, end
        gaps, self._gaps = self._gaps, []
        if previous == 0.0:
            return None
        if self._skip > 0:
            self._skip -= 1
            if self._settle is not None:
                # An overlapped exchange left in flight would be waited for in the next
                # period, for the slowest rank: every rank would measure its pace.
                self._settle()
                self._last_end = self._step_end = self._clock()
            return None
        work = statistics.median(gaps) * len(gaps) if gaps else start - previous
        self._seconds.append(max(work, 1e-9))
        if len(self._seconds) < self._measure:
            return None
        mine = self.shares[self.rank] / statistics.median(self._seconds)
        self._seconds = []
        vector = [0.0] * self.size
        vector[self.rank] = mine
        rates = self._agree(vector)
        self._last_end = self._step_end = self._clock()  # the agreement is not this rank's work
        new = self._decide(rates)
        if new is None or new == self.shares:
            return None
        self.shares = new
        return new

    def _decide(self, rates: list[float]) -> tuple[int, ...] | None:
        """The shares these rates (the same on every rank) call for, or None: keep those in
        force. The first choice takes one measurement; a change after it ``CONFIRM``."""
        if not self._decided:
            self._decided = True
            new = shares_for(rates) if gains(self.shares, rates) else self.shares
            if self.rank == 0:  # the first choice shown by default (as auto compression's)
                log.warning("%s", describe(new, rates, self.shares, self._basis, self._per))
            return new
        if not gains(self.shares, rates):
            self._pending = None  # noise within the margin: nothing moves
            return None
        before, self._pending = self._pending, rates
        if before is None or len(before) != len(rates):
            return None  # one measurement asks for a change: wait for the next
        mean = [(a + b) / 2 for a, b in zip(before, rates)]
        new = shares_for(mean)
        if not all(calls_for(self.shares, new, r) for r in (before, rates)):
            return None  # the two measurements disagree on what to change
        self._pending = None
        if self.rank == 0:
            log.info("%s", describe(new, mean, self.shares, self._basis, self._per))
        return new


def agree_on(group: Group) -> Callable[[list[float]], list[float]]:
    """Every rank's values summed over ``group`` (float64: the same bits on every rank)."""

    def agree(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        group_ops.allreduce(t, group, op="sum")
        return [float(v) for v in t.tolist()]

    return agree
