"""One gradient path: from a ready gradient to updated parameters (issue 24).

A :class:`GradientPath` is the engine behind one ``DistributedOptimizer`` (which keeps Horovod's
API and delegates here). A hook on every trainable parameter fires once its gradient is
accumulated (:mod:`ringtrain.engine.parameters`); the :class:`~ringtrain.engine.planner.Planner`
packs gradients into the buckets of the plan learned in the first step, and its
:class:`~ringtrain.engine.exchange.GradientExchange` launches each bucket's reduction as soon as
the bucket is complete, without negotiating. The step strategy (:mod:`ringtrain.engine.steps`)
turns reduced gradients into updated parameters; the schedule says when: at ``step()``, or
bucket by bucket on the updater thread (:class:`~ringtrain.engine.steps.Overlapped`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ringtrain.collectives.step_timing import RoundEnds
from ringtrain.compression.policy import AutoCompression
from ringtrain.config import Config
from ringtrain.diagnostics import shares as in_force
from ringtrain.diagnostics import timeline
from ringtrain.engine import auto_shares, local_defaults, local_first, local_settings, local_update
from ringtrain.engine.auto_shares import AutoShares, agree_on
from ringtrain.engine.parameters import Hooks, make_watch
from ringtrain.engine.planner import Planner
from ringtrain.engine.settings import Reduction, check_passes
from ringtrain.engine.step_phase import Phase, StepProgress
from ringtrain.engine.steps import BucketUpdates, Overlapped, ShardedUpdate, Update, WholeStep
from ringtrain.engine.steps.sharded import closure_refused
from ringtrain.engine.weighting import Averaging, check_shares
from ringtrain.errors import CollectiveAbortedError, ConfigError, RingtrainError, StepOrderError

log = logging.getLogger("ringtrain")

# Horovod's words, which scripts filter on (warnings.filterwarnings): kept exactly.
STEP_WITHOUT_SKIP = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)


CLOSURE_TWICE = (
    "{} evaluated step()'s closure a second time in one step: DistributedOptimizer averages "
    "the gradients of one evaluation per step, and the ranks' losses differ, so optimizers that "
    "re-evaluate the closure (LBFGS, line searches) cannot be kept in step.\nHINT: use an "
    "optimizer that evaluates it once (SGD, Adam, ...), or call loss.backward() and then "
    "optimizer.step() without a closure."
)


class GradientPath:
    """The engine of one DistributedOptimizer: hooks, plan, exchange, schedule, step strategy."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        comm: Any,
        config: Config,
        reduction: Reduction,
        compression: Any,
        sparse_as_dense: bool,
        params: tuple[list[torch.nn.Parameter], list[str]],
        stall_s: tuple[float, float],
        outer_optimizer: local_update.OuterFactory | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.comm = comm
        self.config = config
        self.reduction = reduction
        self._passes = reduction.passes  # backward_passes_per_step (Horovod scripts set it)
        self.sparse_as_dense = sparse_as_dense
        self.params, self.names = params
        self.schedule = Overlapped.of(optimizer, comm, config)  # None: synchronous
        if self.schedule is not None:
            weakref.finalize(self, self.schedule.close)
        self.planner = Planner(comm, config, compression, self.schedule is not None)
        # Local updates: a number of steps, 0 (synchronous) or "auto" (until its first round of
        # local updates decides: ringtrain.engine.local_first).
        self.sync_every = local_settings.parse_sync_every(config.sync_every)
        self.sync_every_reason = ""
        self._outer_optimizer = outer_optimizer
        self.update = self._make_update()
        self.progress = StepProgress(len(self.params))
        self.should_sync = True  # False inside no_sync()
        self.skip_sync = False  # inside skip_synchronize()
        self._hooks = Hooks(self)
        self._watch = make_watch(self, comm, self.names, stall_s, config.timeout_s)
        self._auto_shares = self._make_auto_shares()
        self.register_hooks()

    def _make_auto_shares(self) -> AutoShares | None:
        """batch_shares="auto": the measurement (equal shares until its first decision)."""
        if self.reduction.shares != "auto" or self.comm.size == 1 or not self.comm.included:
            return None
        agree = agree_on(self.comm.group("engine"))
        if not isinstance(self.update, local_update.LocalUpdate):
            return AutoShares(self.comm.size, self.comm.set_rank, agree)

        def after_exchanges(values: list[float]) -> list[float]:  # the update of the time
            assert isinstance(self.update, local_update.LocalUpdate)
            return self.update.after_exchanges(lambda: agree(values))

        def settle() -> None:  # the round let pass: its exchange ends before the clock starts
            assert isinstance(self.update, local_update.LocalUpdate)
            self.update.after_exchanges(lambda: None)

        # Local updates: measured a round at a time, agreed behind the outer exchanges.
        rank, size = self.comm.set_rank, self.comm.size
        periods = auto_shares.ROUND_PERIODS
        return AutoShares(size, rank, after_exchanges, periods=periods, settle=settle)

    def set_batch_shares(self, shares: object) -> None:
        """New shares from the next step on (the same on every rank, between steps)."""
        self.reduction = dataclasses.replace(self.reduction, shares=check_shares(shares))
        averaging = self.averaging()  # checks one share per rank
        if self.planner.exchange is not None:
            self.planner.exchange.set_scaling(averaging)

    def set_passes(self, passes: int) -> None:
        """Horovod's ``set_backward_passes_per_step``: communicate once every ``passes``
        backward passes from now on, and restart every gradient's count. Mid-accumulation (some
        passes of a step taken, no gradient handed to the exchange yet) the gradients keep what
        they summed and are reduced after ``passes`` more passes, as Horovod's countdown
        restarts. Once a gradient has reached the exchange this step, refused alike on every
        rank: its reduction, scaled for the old count, is under way."""
        self.assign_passes(passes)
        self.progress.counts = [0] * len(self.progress.counts)

    @property
    def passes(self) -> int:
        return self._passes

    @passes.setter
    def passes(self, passes: int) -> None:
        self.assign_passes(passes)

    def assign_passes(self, passes: int) -> None:
        """``optimizer.backward_passes_per_step = n``, as Horovod scripts assign it: the
        counts go on (Horovod's countdowns do), the scaling follows at once."""
        check_passes(passes)
        if Phase.READY in self.progress:
            raise StepOrderError(
                "backward_passes_per_step was changed after this step's gradients reached the "
                "exchange (their reduction has begun).\nHINT: change it between steps (after "
                "optimizer.step()), or before the last backward pass of the step."
            )
        self.drain()  # an overlapped step's updates still use the exchange's scaling
        self._passes = passes
        if self.planner.exchange is not None:  # average_aggregated_gradients: 1/passes
            self.planner.exchange.set_scaling(self.averaging())

    @property
    def shards_state(self) -> bool:
        """Whether this rank keeps only its shard of the optimizer state."""
        return self.config.shard_optimizer and self.comm.size > 1 and self.comm.included

    def _make_update(self) -> Update:
        """The step strategy (see :mod:`ringtrain.engine.steps`)."""
        update: Update
        together = self.comm.size > 1 and self.comm.included
        if self.sync_every == "auto" and together:
            clash = local_first.clash(self.config)
            if clash is not None:
                self._chose(clash, first_round=False)
        if self.sync_every == "auto" and together:
            update = self._local_update(local_first.START_H, measure=True, decides=True)
        elif self.sync_every not in (0, "auto") and together:
            rank, size = self.comm.set_rank, self.comm.size
            every = local_settings.round_steps(self.sync_every, rank, size)
            update = self._local_update(every, measure=local_defaults.wanted(self.config))
        elif self.shards_state:
            update = ShardedUpdate(self.optimizer, self.comm)
        else:
            by_bucket = self.planner.tuner is None and not self.sparse_as_dense
            update = WholeStep(self.optimizer, by_bucket)
        self.planner.scatter = self.config.reduce_scatter and self.shards_state
        self.share_params(update)
        return update

    def _local_update(
        self,
        sync_every: int,
        measure: bool = False,
        decides: bool = False,
    ) -> local_update.LocalUpdate:
        """``measure``: the first round measures the link and may change the Config's outer
        exchange (:mod:`ringtrain.engine.local_defaults`); ``decides``: sync_every="auto"'s
        first round, which also chooses H or synchronous training."""
        c = self.config
        first = local_defaults.FirstRound(c, decides) if measure else None
        return local_update.LocalUpdate(
            self.optimizer,
            self.params,
            self.comm.group("engine"),
            sync_every,
            self._outer_optimizer,
            c.outer_compression,
            c.outer_overlap,
            c.outer_delay,
            c.outer_fragments,
            first,
        )

    def share_params(self, update: Update) -> None:
        self.planner.set_params(self.params, self.names)
        if isinstance(update, ShardedUpdate):
            update.set_params(self.params, self.names)

    def set_params(self, params: list[torch.nn.Parameter], names: list[str]) -> None:
        """A param group was added: learn the plan again."""
        self.drain()
        self.params, self.names = params, names
        self.share_params(self.update)
        self.progress.restart(len(params))
        self.planner.drop_plan()
        self.register_hooks()

    def rejoin(self, comm: Any, job_config: Config) -> None:
        """Elastic: start over alike on every rank on the re-formed world's ``comm``."""
        if self.schedule is not None:
            self.schedule.open = False
        self.comm = comm
        self.planner.rebind(comm, job_config)
        if isinstance(self.update, local_update.LocalUpdate) and comm.size > 1 and comm.included:
            self.update.rejoin(comm.group("engine"))  # the anchor and outer state carry on
        else:
            self.update = self._make_update()  # the old world's shards go with the old strategy
        self.progress.restart(len(self.params))
        self.should_sync = True
        if self._watch is not None:
            self._watch.close()
        self._watch = make_watch(
            self,
            comm,
            self.names,
            (job_config.stall_warning_s, job_config.stall_shutdown_s),
            self.config.timeout_s,
        )
        if self._auto_shares is not None or self.reduction.shares is not None:
            # Elastic: measured shares are measured again; given ones must fit the new world.
            if self._auto_shares is not None:
                self.reduction = dataclasses.replace(self.reduction, shares="auto")
            self._auto_shares = self._make_auto_shares()
        if comm.size == 1:
            self._hooks.remove()
        else:
            self.register_hooks()

    def drain(self) -> None:
        """Overlap: wait for the pending updates, so parameters and state are final."""
        if self.schedule is not None:
            self.schedule.drain()

    # ---- hooks -------------------------------------------------------------------------------

    def register_hooks(self) -> None:
        # Nothing to exchange at world size 1; outside its process set the optimizer steps on
        # local gradients, as Horovod's does.
        if self.comm.size > 1 and self.comm.included:
            self._hooks.add(self.params)

    def remove_hooks(self) -> None:
        self.drain()
        self._hooks.remove()
        self.planner.drop_plan()

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if self.schedule is not None:
            self.schedule.gradient_came()
        if not (self.should_sync and self.update.exchanges()):
            return
        progress, planner = self.progress, self.planner
        if Phase.OPEN not in progress:
            self._open_step()
        progress.start_pass()
        if not progress.count(index, self.passes, self.names[index]):
            return
        grad = param.grad
        if self.sparse_as_dense and grad is not None and grad.is_sparse:
            progress.sparse_back.add(index)
        if planner.learner is not None:
            planner.learner.saw(index, grad is not None and grad.is_sparse)
        else:
            assert planner.exchange is not None
            planner.exchange.ready(index)

    def _open_step(self) -> None:
        """First gradient of a step: the planner decides, alike on every rank, whether this
        step learns the plan."""
        self.progress.set(Phase.OPEN)
        self.planner.open_step()

    def averaging(self) -> Averaging:
        return self.reduction.averaging(self.comm.size, self.passes, self.comm.set_rank)

    # ---- synchronize and step ----------------------------------------------------------------

    def synchronize(self, then: Callable[[int], None] | None = None) -> None:
        """Reduce every gradient; ``then(s)`` runs as soon as bucket ``s`` is reduced (when the
        step is not a learning step: see :meth:`bucket_updates`)."""
        self.drain()
        progress, planner = self.progress, self.planner
        if self.schedule is not None and self.schedule.open and Phase.OPEN not in progress:
            self.schedule.open = False  # overlapped step(), no backward since: updates final
            return
        if self.comm.size == 1 or not self.comm.included:
            self.reduction.local(self.params, self.passes, self.comm.size)
            progress.set(Phase.SYNCHRONIZED)
            return
        observer = self.comm.service("step_timer")
        t0 = time.perf_counter()
        if observer is not None:
            observer.wait_started()
        learning = False
        try:
            if Phase.OPEN not in progress:
                self._open_step()
            learning = planner.learning
            progress.syncs += 1
            back = progress.sparse_back if self.sparse_as_dense else None
            planner.run(
                then, self.averaging(), back, self._watch, progress.syncs, self.register_hooks
            )
        except RuntimeError as e:
            if isinstance(e, RingtrainError):
                raise
            raise _peer_failure(e) from e
        finally:
            progress.ended()
            planner.step_ended()
        t1 = time.perf_counter()
        planner.observe(learning, t0, t1, self.averaging())
        if self._auto_shares is not None:
            shares = self._auto_shares.observe(t0, t1)
            if shares is not None:
                self.set_batch_shares(shares)
        if observer is not None:
            observer.wait_done()
        timeline.current().span("step", "SYNCHRONIZE", t0, t1)
        progress.set(Phase.SYNCHRONIZED)

    def _chose(self, choice: local_first.Choice, first_round: bool = True) -> None:
        """sync_every="auto" has chosen (alike on every rank); a checkpoint keeps the choice
        with compression="auto"'s state (AutoCompression.state_dict)."""
        self.sync_every, self.sync_every_reason = choice.sync_every, choice.why
        if isinstance(self.planner.compression, AutoCompression):
            self.planner.compression.sync_every = choice.sync_every
        if not first_round and self.comm.set_rank == 0:
            log.warning("%s", local_first.line(choice, first_round=False))

    def _after_round(self, update: local_update.LocalUpdate) -> None:
        """sync_every="auto" after an inner step of its first round: take the choice once made;
        synchronous training from the next step once the round that chose it has ended."""
        choice = update.auto_choice
        if choice is None or (choice.sync_every == 0 and not update.left):
            return
        self._chose(choice)
        if update.left:
            update.close()
            self.update = self._make_update()

    def restored(self, compressor_state: dict[str, Any] | None) -> None:
        """A state was loaded; its compressor's state (None: none saved) is loaded now. Then
        sync_every="auto"'s saved choice (kept with compression="auto"'s state), if any, stands:
        local updates every H steps from the round in progress on, or synchronous training now
        (the choice was saved after the switch)."""
        if compressor_state is not None:
            self.planner.load_compressor_state(compressor_state, self.averaging())
        update, compression = self.update, self.planner.compression
        every = compression.sync_every if isinstance(compression, AutoCompression) else None
        if self.sync_every != "auto" or every is None:
            return
        if not isinstance(update, local_update.LocalUpdate):
            return
        why = "restored from a checkpoint, as chosen when the job measured its link."
        choice = local_first.Choice(every, why, None)
        if every:
            update.resume(choice)
            self._chose(choice)
            return
        update.close()
        self._chose(choice, first_round=False)
        self.update = self._make_update()

    def step(self, closure: Callable[[], float] | None) -> Any:
        if closure is not None and self.config.shard_optimizer:
            raise closure_refused()  # before anything runs, at the first step as at the next
        self.drain()
        progress = self.progress
        update = self.update  # sync_every="auto" may choose another one for the next step
        if self.schedule is not None:
            self.schedule.open = False
        if closure is not None and self.should_sync and update.exchanges():
            closure = self._averaged(closure)
        elif self.should_sync and not self.skip_sync and update.exchanges():
            if Phase.SYNCHRONIZED in progress:
                warnings.warn(STEP_WITHOUT_SKIP, stacklevel=3)
            if self._overlapping(closure):
                assert self.schedule is not None
                self.schedule.step(self.planner, update, progress, self._watch)
                return self._step_done(None)
            updates = self.bucket_updates(closure)
            if updates is not None:
                self.synchronize(updates.update)
                if updates.finish():
                    return self._step_done(None)
            else:
                self.synchronize()
        progress.set(Phase.SYNCHRONIZED, False)
        if isinstance(update, local_update.LocalUpdate):
            update.weight = self._outer_weight(update)
            update.watch(self._watch)
        t0 = time.perf_counter()
        update.replan(self.planner.plan)
        local = update if isinstance(update, local_update.LocalUpdate) else None
        rounds, outer_s = (local.outer_steps, local.outer_seconds) if local else (0, 0.0)
        result = update.step(closure)
        t1 = time.perf_counter()
        timeline.current().span("step", "OPTIMIZER_STEP", t0, t1)
        if local is not None and self._auto_shares is not None:
            self._auto_shares.inner_step(t0, t1)
        if local is not None and local.outer_steps != rounds:
            self._round_ended(t0, t1)
        if self.sync_every == "auto" and local is not None:
            self._after_round(local)
        # Outer steps wait for the peers: the straggler report does not count them as compute.
        return self._step_done(result, local.outer_seconds - outer_s if local else 0.0)

    def _averaged(self, closure: Callable[[], float]) -> Callable[[], float]:
        """step(closure): the optimizer must read the average of the gradients the closure's
        backward makes, so the exchange is waited for after the closure, not before it (which
        left the optimizer the rank's own gradient, mid-exchange). A backward or synchronize()
        before step() is synchronized first, as without a closure."""
        progress = self.progress
        before = Phase.OPEN in progress or Phase.SYNCHRONIZED in progress
        if before and not self.skip_sync:
            if Phase.SYNCHRONIZED in progress:
                warnings.warn(STEP_WITHOUT_SKIP, stacklevel=4)
            self.synchronize()
        calls = 0

        def averaged() -> float:
            nonlocal calls
            calls += 1
            if calls > 1:  # where Horovod's zero_grad() raises on its pending exchange
                raise StepOrderError(CLOSURE_TWICE.format(type(self.optimizer).__name__))
            loss = closure()
            # Without a backward before, synchronize even where this rank's closure made no
            # gradient: the peers' exchange includes it (as step() without a closure does).
            if not before or Phase.OPEN in progress:
                self.synchronize()
            return loss

        return averaged

    def _outer_weight(self, update: local_update.LocalUpdate) -> float | None:
        """This rank's weight in local updates' outer average: the samples it takes a round (its
        inner steps times its share of each global batch) over every rank's; None: the plain
        mean. Shares or a per-rank sync_every that do not fit the world (an elastic re-forming)
        are an error at the next step, as a synchronous step's shares are."""
        rank, size = self.comm.set_rank, self.comm.size
        every = update.sync_every if self.sync_every == "auto" else self.sync_every  # 1st round
        if isinstance(every, tuple) and local_settings.round_steps(every, rank, size) != (
            update.sync_every
        ):
            raise ConfigError(
                f"sync_every={list(every)} gives rank {rank} {every[rank]} inner steps a round, "
                f"but its round has {update.sync_every} (the world was re-formed).\nHINT: give "
                "per-rank inner steps only to a world that keeps its ranks, or one number."
            )
        shares = self.reduction.shares
        return local_settings.outer_weight(
            every, shares if isinstance(shares, tuple) else None, rank, size
        )

    def _round_ended(self, t0: float, t1: float) -> None:
        """Local updates: a round ended in the step from ``t0`` to ``t1`` (on every rank at the
        same step): batch_shares="auto" measures there."""
        if self._auto_shares is not None:
            shares = self._auto_shares.observe(t0, t1)
            if shares is not None:
                self.set_batch_shares(shares)

    def bucket_updates(self, closure: Any) -> BucketUpdates | None:
        """The strategy's updates bucket by bucket for a step() that synchronizes, or None
        (a closure, the learning step, no exchange yet; see ``Update.bucket_updates``)."""
        if closure is not None or self.comm.size == 1 or not self.comm.included:
            return None
        if Phase.OPEN not in self.progress:
            self._open_step()  # decides, as synchronize() would, whether this step learns
        planner = self.planner
        if planner.learning or planner.exchange is None or planner.plan is None:
            return None
        return self.update.bucket_updates(planner.exchange, self.comm.service("step_timer"))

    def _overlapping(self, closure: Any) -> bool:
        """Whether this step() overlaps: overlap is on, there is no closure (which must see
        the updated parameters at once), and the schedule applies (see Overlapped.applies)."""
        if self.schedule is None or closure is not None or not self.comm.included:
            return False
        if Phase.OPEN not in self.progress:
            self._open_step()  # decides, as synchronize() would, whether this step learns
        return self.schedule.applies(self.planner, self.names)

    def _step_done(self, result: Any, waited_s: float = 0.0) -> Any:
        self.progress.set(Phase.SYNCHRONIZED, False)
        observer = self.comm.service("step_timer")
        if observer is not None:
            # The straggler report compares ranks per sample where shares are in force.
            shares = self.reduction.shares
            in_force.IN_FORCE.add(shares if isinstance(shares, tuple) else None, self.comm.size)
            observer.waited(waited_s)
            local = isinstance(self.update, local_update.LocalUpdate)
            compression, trial = self.planner.compression_in_use()
            observer.step_done(self._rounds(), local, compression, trial)
        return result

    def _rounds(self) -> RoundEnds | None:
        """Per-rank inner steps (``sync_every=[48, 16]``): the ranks' step counts differ, so the
        straggler report comes at rounds' ends (a report at the same step number would wait for
        a rank that is waiting for this one's next outer step)."""
        every = local_settings.parse_sync_every(self.config.sync_every)
        if not isinstance(every, tuple) or not isinstance(self.update, local_update.LocalUpdate):
            return None
        return RoundEnds(self.update.outer_steps, min(every))

    def zero_grad(self, set_to_none: bool) -> None:
        if Phase.OPEN in self.progress:  # as Horovod: after any backward pass, even one of k
            raise StepOrderError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize().\nHINT: this is usually a missing optimizer.step()."
            )
        if self.schedule is not None and self.schedule.zero_grad(self.params, set_to_none):
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _peer_failure(e: RuntimeError) -> CollectiveAbortedError:
    """Torch's bare transport error ``e`` (a peer killed without last words to read: see
    runtime.departures) as a :class:`CollectiveAbortedError`, a ``HorovodInternalError``, as
    Horovod's ``synchronize`` raises every failed reduction."""
    return CollectiveAbortedError(
        "DistributedOptimizer: reducing the gradients failed "
        f"({type(e).__name__}: {' '.join(str(e).split())[:300]}).\n"
        "HINT: where a peer rank failed or became unreachable, the launcher's message names "
        "the rank that failed first."
    )
