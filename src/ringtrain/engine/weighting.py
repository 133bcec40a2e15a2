"""The one averaging place of the gradient engine: the scale factors of a step's reduction.

A step's reduction is a sum with factors around it (``pre`` on each rank's contribution,
``post`` on the result). The plain average divides by the number of ranks; with per-rank shares
of the global batch (``DistributedOptimizer(batch_shares=...)``), rank r's contribution is
scaled by ``w_r = share_r / sum(shares)`` instead, so the step is the one a single process
would take on the whole global batch (each rank's loss being the mean over its own samples).
Equal shares take the plain path: the same bits as without ``batch_shares``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ringtrain.compression import averaging
from ringtrain.errors import ConfigError


@dataclass(frozen=True)
class Averaging:
    """What a step's reduction asks for (Average or Sum, over how many ranks, Horovod's
    ``gradient_predivide_factor``, 1/k for k aggregated backward passes, this rank's weight
    under ``batch_shares``); the factors come from the one averaging rule
    (:mod:`ringtrain.compression.averaging`)."""

    average: bool
    size: int
    predivide: float = 1.0
    k_scale: float = 1.0  # 1/k when averaging aggregated backward passes
    # batch_shares: this rank's share over the sum of shares (w_r), replacing 1/size; None: the
    # plain average (equal shares take that path, so their bits are today's).
    weight: float | None = None

    def factors(self) -> tuple[float, float]:
        """(pre, post) scale factors around the sum. The division by the world size goes before
        the sum whatever the dtype, as DDP's does: it rides on the copy into the bucket, the
        result needs no pass of its own, and a 16-bit sum is already the average, so it cannot
        overflow unless an averaged value does. ``gradient_predivide_factor`` splits it, as in
        Horovod: 1/f before, f/size after. With a ``weight`` w_r, the contribution is scaled by
        w_r before the sum (a weighted average: as safe from 16-bit overflow as the plain one),
        and a predivide factor still splits it (w_r size / f before, f / size after)."""
        if not self.average:
            return self.k_scale, 1.0
        split = self.predivide != 1.0
        if self.weight is not None:
            if not split:
                return self.k_scale * self.weight, 1.0
            return self.k_scale * self.weight * self.size / self.predivide, (
                self.predivide / self.size
            )
        f = averaging.factors(
            True,
            self.size,
            pre=self.k_scale / self.predivide,
            post=self.predivide,
            before=not split,
        )
        return f.pre, f.post

    def codec_factors(self) -> tuple[float, float]:
        """(pre, post) around a codec with rounds of its own, which returns the average. Sum
        wants it times the size; a weight scales the contribution by w_r size first, so the
        codec's average is the weighted one (as exact as the codec is: linear in its input)."""
        if self.weight is not None and self.average:
            return self.k_scale * self.weight * self.size, 1.0
        return 1.0, self.k_scale * (1.0 if self.average else self.size)

    def sparse_factors(self) -> tuple[float, float]:
        """(before, after): sparse gradients are all-gathered and summed locally; a weight
        scales this rank's values before the gather, the plain factors scale the sum after."""
        pre, post = self.factors()
        if self.weight is not None and self.average:
            return pre * post, 1.0
        return 1.0, pre * post


def weight_of(shares: Sequence[float] | None, rank: int, size: int) -> float | None:
    """Rank ``rank``'s weight ``share / sum(shares)``; None where the plain average is the same
    (no shares, or all equal). A list whose length is not the world size is an error."""
    if shares is None:
        return None
    if len(shares) != size:
        raise ConfigError(
            f"batch_shares has {len(shares)} entries but the process set has {size} ranks.\n"
            "HINT: give one share per rank (in rank order), or batch_shares='auto'."
        )
    if all(s == shares[0] for s in shares):
        return None
    return float(shares[rank]) / float(sum(shares))


def check_shares(shares: object) -> tuple[float, ...] | str | None:
    """``batch_shares`` as given: None, ``"auto"``, or positive numbers (one per rank)."""
    if shares is None or shares == "auto":
        return shares
    if isinstance(shares, str) or not isinstance(shares, Sequence):
        raise ConfigError(
            f"batch_shares must be a list of positive numbers (one per rank) or 'auto', got "
            f"{shares!r}"
        )
    values = tuple(shares)
    if not values or any(
        isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0 or s != s
        for s in values
    ):
        raise ConfigError(
            f"batch_shares must be positive numbers, one per rank, got {list(values)!r}.\n"
            "HINT: the samples each rank takes of a global batch, e.g. [3, 1]."
        )
    return tuple(float(s) for s in values)
