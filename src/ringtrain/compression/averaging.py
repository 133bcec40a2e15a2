"""The averaging rule, once for every path that averages: collectives, the engine, the codecs.

An average is a sum divided by its contributors (joined ranks included). Where the division
goes is the only choice, and it is made here:

* around a sum on the wire (:func:`factors`): Horovod's ``prescale_factor``/``postscale_factor``
  with the division folded in. 16-bit floats are divided *before* the sum, so their sums cannot
  overflow unless an averaged value does; everything else after (Horovod's rule). A caller that
  divides before the sum whatever the dtype says so (``before=True``: the gradient engine, where
  the division rides on the copy into the bucket, as DDP's does). Factors are multiplied in;
  integers are scaled in double precision and truncated toward zero, as Horovod's
  ``ScaleBuffer`` (-75 / 2 gives -37, not -38): :func:`scale`;
* inside a codec that sums in its own rounds (PowerSGD's factors, top-k's scattered values, the
  outer exchange, the sealed ring's AVG): :func:`mean` divides the sum in place, integers
  truncated alike.

One exception, kept for Horovod's contract: ``sparse_allreduce`` (collectives/async_ops.py)
divides its gathered values as Horovod's does, ``values / size`` (a float division, integer
values included).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Factors:
    """Scale factors applied to each contribution before the sum and to the result after."""

    pre: float
    post: float

    def before(self, t: torch.Tensor) -> None:
        if self.pre != 1.0:
            scale(t, self.pre)

    def after(self, t: torch.Tensor) -> None:
        if self.post != 1.0:
            scale(t, self.post)


def factors(
    average: bool,
    contributors: int,
    dtype: torch.dtype | None = None,
    pre: float = 1.0,
    post: float = 1.0,
    before: bool | None = None,
) -> Factors:
    """``pre`` and ``post`` with an average's division by ``contributors`` folded into one of
    them: before the sum if ``before``, after it if not; ``before=None`` decides by ``dtype``
    (16-bit floats before, the rest after)."""
    if average:
        if before if before is not None else dtype in LOW_PRECISION:
            pre /= contributors
        else:
            post /= contributors
    return Factors(pre, post)


def scale(t: torch.Tensor, factor: float) -> None:
    """``t *= factor`` in place; integers in double precision, truncated toward zero."""
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_((t.double() * factor).to(t.dtype))


def mean(t: torch.Tensor, contributors: int) -> torch.Tensor:
    """The sum ``t`` of ``contributors`` values becomes their mean, in place (returned)."""
    if t.is_floating_point() or t.is_complex():
        return t.div_(contributors)
    scale(t, 1.0 / contributors)
    return t
