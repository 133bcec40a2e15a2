"""What shares of the global batch in proportion to speed would gain (``batch_shares``).

Data-parallel ranks step together, so with equal shares a step's busy part (input and compute)
takes the slowest rank's time. With shares in proportion to each rank's rate every rank is busy
for the same time: for busy times ``b_r`` measured at equal shares, ``N / sum(1 / b_r)``. The
communication a step exposes is left as it is (the same bytes are reduced whatever the split).

Used by the straggler report (rates from its per-rank busy times) and by ``ringtrain doctor``
(rates from a compute probe on every host), which print :meth:`SharesGain.line` or, with
relative rates only, :meth:`SharesGain.relative_line`. Pure: numbers in, numbers and a line out.
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

    @property
    def gain(self) -> float:
        """Samples per second in proportion over those at equal shares."""
        return self.equal_step_s / self.shared_step_s if self.shared_step_s > 0 else 1.0

    def line(self) -> str:
        """One line: both predicted step times, the gain and the shares to set."""
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


def predict(busy_s: Sequence[float], comm_s: float = 0.0) -> SharesGain:
    """The gain for ranks busy ``busy_s`` seconds per step at equal shares, a step exposing
    ``comm_s`` seconds of communication. Busy times must be positive."""
    if not busy_s or any(not b > 0 for b in busy_s):
        raise ValueError(f"busy times must be positive, one per rank, got {list(busy_s)!r}")
    if not comm_s >= 0:
        raise ValueError(f"communication time must be >= 0, got {comm_s!r}")
    rates = [1.0 / b for b in busy_s]
    whole = sum(rates)
    shares = tuple(max(1, round(SCALE * r / whole)) for r in rates)
    return SharesGain(shares, max(busy_s) + comm_s, len(busy_s) / whole + comm_s)


def from_rates(rates: Sequence[float], comm_s: float = 0.0) -> SharesGain:
    """The same from rates (work per second at equal shares): busy time ``1 / rate``."""
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be positive, one per rank, got {list(rates)!r}")
    return predict([1.0 / r for r in rates], comm_s)
