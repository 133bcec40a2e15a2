"""Step strategies: how reduced gradients become updated parameters (issue 24, "Update").

:class:`ringtrain.engine.optimizer.DistributedOptimizer` coordinates Horovod's API (hooks,
``synchronize()``, ``step()``, ``state_dict()``) over two pieces:

* the *step strategy* (:class:`Update`), one object per optimizer: :class:`WholeStep`
  (``optimizer.step()`` after the exchange, or bucket by bucket as each bucket's reduction
  completes where that is the same computation), :class:`ShardedUpdate` (ZeRO stage 1: this
  rank's shard of every bucket steps, then the parameters are all-gathered; with or without
  ``reduce_scatter``);
* the *schedule*: synchronous (``step()`` waits for the exchange), or overlapped
  (:class:`Overlapped`: ``step()`` returns once the buckets are launched and the strategy's
  per-bucket update runs on the updater thread as each bucket lands). Overlap is the schedule's
  property; a strategy only says how one bucket is updated.

The interface, what the coordinator calls and when:

``exchanges()``
    When a step's first gradient is ready, and at ``step()``: whether this step's gradients
    are reduced at all.
    Every strategy here says True; a local-update strategy (DiLoCo, issue 28) says False for
    the steps between its outer synchronizations, and the coordinator then steps locally.
``bucket_updates(exchange, timer)``
    Synchronous schedule: a :class:`BucketUpdates` whose ``update(s)`` runs as bucket ``s`` is
    reduced, or None for one update after the whole exchange.
``bucket_update(group)``
    Overlapped schedule: the update of one bucket on the updater thread (``group`` is that
    thread's own process group), or None for the wrapped optimizer's own per-bucket update.
``step(closure)``
    After the exchange: update every parameter (the whole step).
``state_dict()`` / ``load_state_dict(sd)`` / ``state_bytes``
    The optimizer state in torch's format (full, whatever the strategy holds), and the bytes
    of it this rank holds.
``held()``
    Checkpoints (:mod:`ringtrain.checkpoint.optimizer_state`): this rank's pieces of the state
    without a collective; None when the wrapped optimizer holds it whole.
``replan(plan)``
    Before each update: the bucket plan in force (None before the first). An elastic rejoin
    makes a new strategy: what was cut for the old world is dropped with the old one.

A new strategy (the local-update step of issue 28) implements these and is chosen in
``DistributedOptimizer.__init__`` (:func:`ringtrain.engine.steps.choose`).
"""

from __future__ import annotations

from ringtrain.engine.steps.base import Update
from ringtrain.engine.steps.overlapped import Overlapped
from ringtrain.engine.steps.sharded import ShardedUpdate
from ringtrain.engine.steps.whole import BucketUpdates, WholeStep

__all__ = ["BucketUpdates", "Overlapped", "ShardedUpdate", "Update", "WholeStep"]
