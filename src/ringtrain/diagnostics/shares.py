"""What shares of the global batch in proportion to speed would gain (``batch_shares``).

Data-parallel ranks step together, so with equal shares a step's busy part (input and compute)
takes the slowest rank's time. With shares in proportion to each rank's rate every rank is busy
for the same time: for busy times ``b_r`` measured at equal shares, ``N / sum(1 / b_r)``. The
communication a step exposes is left as it is (the same bytes are reduced whatever the split).

Where shares are in force, the busy times were measured at them: rank r's time for an equal
share is ``b_r / (N f_r)`` (``f_r`` its fraction of the global batch), and the gain is over the
step at the shares in force (the slowest rank's busy time as measured).

Used by the straggler report (rates from its per-rank busy times) and by ``ringtrain doctor``
(rates from a compute probe on every host), which print :meth:`SharesGain.line` or, with
relative rates only, :meth:`SharesGain.relative_line`. Pure: numbers in, numbers and a line out,
but for :data:`IN_FORCE`, where the engine records the shares each step takes and the straggler
report reads their mean over its window (an event sink, as the timeline is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Shares are shown as whole numbers out of this (each at least 1): a list to paste into
# batch_shares, which takes any positive numbers.
SCALE = 100


@dataclass(frozen=True)
class SharesGain:
    """A step's predicted time at equal shares and at shares in proportion to the rates."""

    shares: tuple[int, ...]  # out of about SCALE, in rank order
    equal_step_s: float  # the slowest rank's busy time + the exposed communication
    shared_step_s: float  # every rank busy N / sum(1/b) + the same communication
    # Shares in force when the times were measured (fractions of the global batch), and the step
    # measured at them; None: equal shares.
    in_force: tuple[float, ...] | None = None
    now_step_s: float | None = None

    @property
    def gain(self) -> float:
        """Samples per second in proportion over those at the shares in force (equal if none)."""
        now = self.equal_step_s if self.now_step_s is None else self.now_step_s
        return now / self.shared_step_s if self.shared_step_s > 0 else 1.0

    def line(self) -> str:
        """One line: the predicted step times, the gain and the shares to set."""
        if self.in_force is not None and self.now_step_s is not None:
            return (
                f"batch_shares would gain {self.gain:.2f}x samples/s over the shares in force "
                f"{shown(self.in_force)}: a step {self.now_step_s:.3f} s with them, "
                f"{self.shared_step_s:.3f} s with shares in proportion to each rank's speed "
                f"({self.equal_step_s:.3f} s with equal shares); {self.advice()}"
            )
        return (
            f"batch_shares would gain {self.gain:.2f}x samples/s: a step "
            f"{self.equal_step_s:.3f} s with equal shares, {self.shared_step_s:.3f} s with shares "
            f"in proportion to each rank's speed; {self.advice()}"
        )

    def relative_line(self) -> str:
        """The same where only the ranks' relative speeds are known (no step time)."""
        return (
            f"batch_shares would gain {self.gain:.2f}x samples/s: a step's compute "
            f"{1 / self.gain:.2f}x that at equal shares with shares in proportion to each rank's "
            f"speed; {self.advice()}"
        )

    def advice(self) -> str:
        return f"set batch_shares={list(self.shares)} (rank order) or 'auto'"


def predict(
    busy_s: Sequence[float], comm_s: float = 0.0, in_force: Sequence[float] | None = None
) -> SharesGain:
    """The gain for ranks busy ``busy_s`` seconds per step at equal shares (or at the shares
    ``in_force``, positive numbers in rank order), a step exposing ``comm_s`` seconds of
    communication. Busy times must be positive."""
    if not busy_s or any(not b > 0 for b in busy_s):
        raise ValueError(f"busy times must be positive, one per rank, got {list(busy_s)!r}")
    if not comm_s >= 0:
        raise ValueError(f"communication time must be >= 0, got {comm_s!r}")
    fractions = None if in_force is None else fractions_of(in_force, len(busy_s))
    equal = per_equal_share(busy_s, fractions)
    rates = [1.0 / b for b in equal]
    whole = sum(rates)
    shares = tuple(max(1, round(SCALE * r / whole)) for r in rates)
    shared = len(busy_s) / whole + comm_s
    if fractions is None:
        return SharesGain(shares, max(busy_s) + comm_s, shared)
    return SharesGain(shares, max(equal) + comm_s, shared, fractions, max(busy_s) + comm_s)


def fractions_of(shares: Sequence[float], size: int) -> tuple[float, ...]:
    """``shares`` (positive, one per rank) as fractions of the global batch."""
    if len(shares) != size or any(not s > 0 for s in shares):
        raise ValueError(f"shares must be {size} positive numbers, got {list(shares)!r}")
    whole = float(sum(shares))
    return tuple(s / whole for s in shares)


def per_equal_share(seconds: Sequence[float], fractions: Sequence[float] | None) -> list[float]:
    """Each rank's ``seconds`` (measured at ``fractions`` of the global batch; None: equal)
    scaled to an equal share: ``seconds_r / (N f_r)``."""
    if fractions is None:
        return list(seconds)
    n = len(seconds)
    return [s / (n * f) for s, f in zip(seconds, fractions)]


def shown(fractions: Sequence[float]) -> str:
    """Fractions as the whole numbers out of ``SCALE`` a user would set, e.g. ``[75, 25]``."""
    return str([round(SCALE * f) for f in fractions])


class InForce:
    """The shares of the global batch in force over a straggler report's window: the engine
    adds each step's (:meth:`add`), the report takes their mean (:meth:`take`), which starts
    the next window. Kept per process; every rank adds the same shares at the same steps."""

    def __init__(self) -> None:
        self._sum: list[float] = []
        self._steps = 0
        self._unequal = False

    def add(self, shares: Sequence[float] | None, size: int) -> None:
        """One step taken at ``shares`` (None: equal) by ``size`` ranks; another size (an
        elastic change) starts the window again. Shares not one positive number per rank
        are left out (the step goes on; the report then assumes what it has)."""
        if shares is not None and (len(shares) != size or any(not s > 0 for s in shares)):
            return
        fractions = (1.0 / size,) * size if shares is None else fractions_of(shares, size)
        if len(self._sum) != size:
            self._sum, self._steps, self._unequal = [0.0] * size, 0, False
        self._sum = [a + f for a, f in zip(self._sum, fractions)]
        self._steps += 1
        self._unequal = self._unequal or len(set(fractions)) > 1

    def take(self) -> tuple[float, ...] | None:
        """The mean fractions since the last take (None: equal shares throughout, or no step
        recorded), and a new window."""
        mean = tuple(a / self._steps for a in self._sum) if self._unequal else None
        self._sum, self._steps, self._unequal = [], 0, False
        return mean


# The engine's record for the straggler report (ringtrain.diagnostics.straggler.analyse).
IN_FORCE = InForce()


def from_rates(rates: Sequence[float], comm_s: float = 0.0) -> SharesGain:
    """The same from rates (work per second at equal shares): busy time ``1 / rate``."""
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be positive, one per rank, got {list(rates)!r}")
    return predict([1.0 / r for r in rates], comm_s)
