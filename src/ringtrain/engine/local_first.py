"""``sync_every="auto"`` decides from one round of local updates, not from synchronous steps.

Measuring on synchronous steps costs most where local updates are needed: at 10 Mbit/s three
synchronous steps of a 1.3M-parameter model outlast one host's whole run (issue 40). So an
``auto`` job starts as a bare ``sync_every=START_H`` does: each rank trains alone and times its
inner steps; at the round's first outer exchange the link is probed and every figure agreed
(:class:`ringtrain.engine.local_defaults.FirstRound`). Those figures decide, on every rank
alike (pure functions of agreed numbers):

* local updates win (synchronous training predicted under
  :data:`ringtrain.engine.auto.SYNC_EFFICIENCY` of the compute speed): the round's exchange
  runs with the chosen outer exchange, and the next rounds take the chosen ``H``
  (:func:`ringtrain.engine.local_policy.choose_local`);
* synchronous training wins (a fast link): the round's exchange is a plain average of the
  weights and of the inner optimizer's state (Adam's moments), so every rank holds the same
  model and state, and training goes on synchronously from the next step, ``compression="auto"``
  choosing its compression as it would have from the first step.

Either way the first ``START_H`` steps were local updates: on a fast link the job's numerics
are those of synchronous training started from one round of model averaging, the same on every
run (the decision depends on timing, the user's opt-in with ``"auto"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringtrain.compression.policy import Measurement
from ringtrain.config import Config
from ringtrain.engine import auto, local_policy
from ringtrain.engine.local_settings import clashes, given_outer

# The first round's H: the smallest H local_policy considers (a shorter round overshoots with
# DiLoCo's outer Nesterov step), short enough that a fast link loses little to it.
START_H = local_policy.SYNC_EVERY_CHOICES[0]
ELEMENT_SIZE = 4  # float32 gradients on the synchronous path's wire (uncompressed)


@dataclass(frozen=True)
class Choice:
    """What ``auto`` decided: ``sync_every`` (0: synchronous), why, and local updates' outer
    exchange (None: synchronous)."""

    sync_every: int
    why: str
    outer: local_policy.OuterSettings | None


def measurement(
    numel: int, size: int, fusion_bytes: int, compute_s: float, latency_s: float, bps: float
) -> Measurement:
    """The synchronous step as the first round predicts it: the gradients of ``numel`` floats
    each step in buckets of ``fusion_bytes``, at the probed rate, none of it hidden behind
    backward (a bound: synchronous training overlaps some of it)."""
    grad_bytes = numel * ELEMENT_SIZE
    buckets = max(1, math.ceil(grad_bytes / fusion_bytes)) if fusion_bytes > 0 else 1
    comm = buckets * latency_s + grad_bytes / bps
    return Measurement(
        world_size=size,
        grad_bytes=grad_bytes,
        grad_numel=numel,
        element_size=ELEMENT_SIZE,
        buckets=buckets,
        compute_s=compute_s,
        wait_s=comm,
        comm_s=comm,
        latency_s=latency_s,
        bytes_per_s=bps,
        powersgd_wire_numel=0,
        powersgd_collectives=0,
        topk_ratio=0.0,
    )


def predicted_step_s(m: Measurement) -> dict[str, float]:
    """Synchronous step times with the exchanges the first round can predict: uncompressed and
    16-bit (PowerSGD needs the bucket plan, which only a synchronous step learns)."""
    latency = m.buckets * m.op_overhead_s
    return {
        "none": m.compute_s + latency + m.grad_bytes / m.bytes_per_s,
        "fp16": m.compute_s + latency + m.grad_bytes / 2 / m.bytes_per_s,
    }


def decide(config: Config, m: Measurement) -> Choice:
    """``auto``'s choice on the agreed figures ``m`` (:func:`measurement`), the user's outer
    settings honoured. Pure: equal figures, equal answer."""
    given = given_outer(config)
    every, why = auto.choose_sync_every(m, predicted_step_s(m), given)
    if not every:
        return Choice(0, why, None)
    return Choice(every, why, auto.outer_for(m, every, given))


def clash(config: Config) -> Choice | None:
    """Synchronous from the first step where a setting makes no sense with local updates
    (``shard_optimizer``, ``overlap``); None: start with a round of local updates."""
    if not clashes(config):
        return None
    return Choice(0, f"{clashes(config)} is set, which local updates cannot use.", None)


def line(choice: Choice, first_round: bool = True) -> str:
    """The log line (rank 0 writes it); ``first_round``: the choice ended a round of local
    updates (not a clash at the start)."""
    if choice.sync_every:
        chosen = f"local updates every {choice.sync_every} steps"
    elif first_round:
        chosen = f"synchronous training after {START_H} steps of local updates"
    else:
        chosen = "synchronous training"
    return f"ringtrain sync_every=auto chose {chosen}: {choice.why}"
