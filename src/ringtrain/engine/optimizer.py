"""DistributedOptimizer: Horovod's API over the engine's one gradient path.

It wraps the user's optimizer by composition; averaging gradients while backward still runs is
the :class:`~ringtrain.engine.gradient_path.GradientPath`'s work (hooks, the bucket plan, the
exchange, the schedule, the step strategy of :mod:`ringtrain.engine.steps`). Here: Horovod's
arguments, its errors and warnings, ``state_dict``, ``skip_synchronize``/``no_sync``, and what
tests, benchmarks and checkpoints read.

Limits, stated plainly: ``requires_grad`` must change identically on every rank and between
steps (as with DDP); ``ringtrain.join()`` does not stand in for the gradient exchange of a rank
that stopped training (use it for explicit collectives only).

The wrapper subclasses ``torch.optim.Optimizer`` (sharing ``param_groups`` and ``state`` with the
wrapped optimizer) only so that LR schedulers and ``isinstance`` checks accept it; it never runs
``Optimizer.__init__``. Its instances' classes derive from the wrapped optimizer's class too.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ringtrain.collectives import ops
from ringtrain.collectives.reduce_ops import ReduceOpLike
from ringtrain.compression import CompressionLike
from ringtrain.compression.policy import AutoCompression, Decision
from ringtrain.engine import local_settings, local_update, optimizer_class, settings, sharded
from ringtrain.engine.buckets import Plan
from ringtrain.engine.exchange import GradientExchange
from ringtrain.engine.gradient_path import GradientPath
from ringtrain.engine.parameters import names_of
from ringtrain.engine.steps import Update
from ringtrain.errors import ConfigError
from ringtrain.runtime import state as runtime_state
from ringtrain.runtime.process_sets import ProcessSet

# Key under which state_dict() keeps the compressor's state next to the optimizer's.
COMPRESSOR_STATE_KEY = "ringtrain_compressor"


def _delegated(owner: str, name: str) -> Any:
    """An attribute of ``self.<owner>``, read and written through the wrapper."""
    return property(
        lambda self: getattr(getattr(self, owner), name),
        lambda self, value: setattr(getattr(self, owner), name, value),
    )


class DistributedOptimizer(torch.optim.Optimizer):
    """Horovod's ``DistributedOptimizer``: same arguments, same behaviour, plus engine knobs.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` and ``state`` are shared).
        named_parameters: ``model.named_parameters()``; names label buckets in errors and in the
            timeline. Without them, parameters get Horovod's names,
            ``allreduce.noname.<group>.<position>`` in ``optimizer.param_groups``. Every rank
            must pass the same parameters in the same order.
        compression: ``Compression.none``, ``Compression.fp16``, ``.bf16``, a registered name
            (``"powersgd"``, ``"topk"``, whose settings come from the Config: ``powersgd_rank``,
            ``powersgd_start_step``, ``topk_ratio``), ``"auto"`` (measure, then choose), or an
            object with ``compress``/``decompress`` or ``reduce``
            (:class:`ringtrain.compression.base.GradientReducer`), e.g.
            ``Compression.powersgd(matrix_approximation_rank=4)``.
        backward_passes_per_step: communicate once every this many backward passes; gradients
            accumulate locally in between (as in Horovod, they are summed, not averaged: scale the
            loss by 1/k, or pass ``average_aggregated_gradients=True``, to match a k-times batch).
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: divide gradients by this before the sum and by
            ``size / factor`` after it (Average only). With a 16-bit wire and the default 1.0,
            the whole division by the world size happens before the cast.
        num_groups, groups: accepted for Horovod scripts and ignored, with a warning: the engine
            groups gradients into buckets itself.
        sparse_as_dense: send sparse gradients as dense tensors instead of as (indices, values).
        process_set: reduce over this process set instead of the world.
        average_aggregated_gradients: keyword-only, as every argument after Horovod's
            positional ones: see ``backward_passes_per_step``.
        fusion_threshold_bytes, cycle_time_ms, bucket_order, hierarchical, engine_streams,
            reproducible, link_class, shard_optimizer, reduce_scatter, overlap, sync_every,
            outer_compression, outer_overlap, outer_delay, outer_fragments: the engine's settings,
            keyword-only, described in
            :mod:`ringtrain.engine.settings`. Left as None
            they come from :class:`ringtrain.config.Config` (``RINGTRAIN_*`` variables, which
            ``ringtrain run`` flags set), then the defaults: arguments win.
        batch_shares: each rank's share of the global batch, one number per rank in rank order
            (e.g. ``[3, 1]``: rank 0 takes 3 samples for rank 1's 1): rank r's gradient weighs
            ``share_r / sum(shares)`` instead of ``1/size``, so with each rank's loss the mean
            over its own samples the step is that of one process on the whole global batch.
            Equal shares are the plain average, bit for bit. ``"auto"``: measured, in proportion
            to each rank's rate (:mod:`ringtrain.engine.auto_shares`; timing-dependent, so not
            reproducible run to run); read them from :attr:`batch_shares` (docs/engine.md,
            "Hosts of unequal speed").
        outer_optimizer: with ``sync_every``, ``params -> torch.optim.Optimizer`` for the outer
            step (default: Nesterov SGD, lr 0.7, momentum 0.9, as arXiv 2311.08105).
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        # Derived from the wrapped optimizer's class too, as Horovod's is (optimizer_class.py).
        return super().__new__(optimizer_class.for_wrapped(cls, optimizer))

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        compression: CompressionLike | None = None,
        backward_passes_per_step: int = 1,
        op: ReduceOpLike | None = None,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: object = None,
        sparse_as_dense: bool = False,
        process_set: ProcessSet | None = None,
        *,  # above: Horovod's positional order; below: ringtrain's (and TF Horovod's) by name
        average_aggregated_gradients: bool = False,
        fusion_threshold_bytes: int | None = None,
        cycle_time_ms: float | None = None,
        bucket_order: str | None = None,
        hierarchical: str | None = None,
        engine_streams: int | None = None,
        reproducible: bool | None = None,
        link_class: str | None = None,
        shard_optimizer: bool | None = None,
        overlap: bool | None = None,
        reduce_scatter: bool | None = None,
        sync_every: int | str | Sequence[int] | None = None,
        outer_optimizer: local_update.OuterFactory | None = None,
        outer_compression: str | None = None,
        outer_overlap: bool | None = None,
        outer_delay: int | None = None,
        outer_fragments: int | None = None,
        batch_shares: Sequence[float] | str | None = None,
    ) -> None:
        # Deliberately no super().__init__(): all optimizer state lives in the wrapped optimizer.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigError(
                "this optimizer is already a DistributedOptimizer; wrap the plain optimizer once"
            )
        reduction = settings.Reduction.of(
            op,
            gradient_predivide_factor,
            backward_passes_per_step,
            average_aggregated_gradients,
            batch_shares,
        )
        settings.check_groups(groups, num_groups)
        self.optimizer = optimizer
        # Names are checked before anything needs init(), as in Horovod.
        named = names_of(optimizer, named_parameters, {})
        self._process_set = process_set
        if process_set is not None and not process_set.communicator.included:  # registered?
            # Outside its set the optimizer only steps on local gradients (Horovod's behaviour).
            job_config, comm = runtime_state.current().config, process_set.communicator
        else:
            controller = ops.controller_of(process_set)
            job_config, comm = controller.config, controller.comm
        # The arguments given replace the Config's, which checks them.
        config = settings.resolve(
            job_config,
            fusion_threshold_bytes=fusion_threshold_bytes,
            cycle_time_ms=cycle_time_ms,
            bucket_order=bucket_order,
            hierarchical=hierarchical,
            engine_streams=engine_streams,
            reproducible=reproducible,
            link_class=link_class,
            shard_optimizer=shard_optimizer,
            overlap=overlap,
            reduce_scatter=reduce_scatter,
            sync_every=sync_every,
            outer_compression=outer_compression,
            outer_overlap=outer_overlap,
            outer_delay=outer_delay,
            outer_fragments=outer_fragments,
        )
        if config.sync_every == "auto":
            compression = local_settings.auto_compression(compression, config)
        local_settings.check(config)
        if config.shard_optimizer:
            sharded.check_supported(optimizer)
        reduction = settings.check(config, reduction)
        self._path = GradientPath(
            optimizer,
            comm,
            config,
            reduction,
            config.compression if compression is None else compression,
            sparse_as_dense,
            named,
            (job_config.stall_warning_s, job_config.stall_shutdown_s),
            outer_optimizer,
        )
        _live.add(self)

    def rejoin(self) -> None:
        """Elastic: the world was re-formed (:mod:`ringtrain.elastic`); take its communicator and
        start over alike on every rank: the bucket plan is learned again, compression state
        (PowerSGD/top-k error feedback, the auto tuner) starts afresh, and a measured link class
        is measured again. Called for every live optimizer by ``@elastic.run``."""
        if self._process_set not in (None, runtime_state.global_process_set):
            return  # its process set is gone with the old world; it cannot be used again
        controller = ops.controller_of(self._process_set)
        with contextlib.suppress(Exception):  # the old world's failure, already reported
            self.drain()
        self._path.rejoin(controller.comm, controller.config)

    # ---- the torch.optim.Optimizer surface, delegated ----------------------------------------

    param_groups = _delegated("optimizer", "param_groups")
    state = _delegated("optimizer", "state")
    defaults = _delegated("optimizer", "defaults")
    backward_passes_per_step = _delegated("_path", "passes")

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict, plus the compressor's state (if it has any)
        under ``"ringtrain_compressor"``. A stateful compressor's state can differ per rank
        (e.g. PowerSGD's error feedback): save every rank's to resume it exactly. Sharded, the
        full state is gathered from every rank's shards: collective, every rank calls it."""
        self.drain()
        sd = self._path.update.state_dict()
        comp_state = self._path.planner.compressor_state()
        if comp_state is not None:
            sd[COMPRESSOR_STATE_KEY] = comp_state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.drain()
        sd = dict(state_dict)
        saved = sd.pop(COMPRESSOR_STATE_KEY, None)
        if not isinstance(self._path.update, local_update.LocalUpdate):
            sd.pop(local_update.STATE_KEY, None)  # saved with local updates, resumed without
        self._path.update.load_state_dict(sd)
        self._path.restored(saved)  # the compressor's state, and sync_every="auto"'s choice

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.drain()
        self.optimizer.add_param_group(param_group)
        self._path.set_params(*names_of(self.optimizer, None, self._parameter_names))

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead"
        )

    # ---- introspection (tests, benchmarks, timeline, checkpoints) ----------------------------

    @property
    def plan(self) -> Plan | None:
        """The agreed bucket plan; None until the first step."""
        return self._path.planner.plan

    @property
    def update(self) -> Update:
        """The step strategy (:mod:`ringtrain.engine.steps`); checkpoints read its ``held()``."""
        return self._path.update

    @property
    def local_update(self) -> local_update.LocalUpdate | None:
        """The local-update step (sync_every), or None while training synchronously."""
        update = self._path.update
        return update if isinstance(update, local_update.LocalUpdate) else None

    @property
    def sync_every_reason(self) -> str:
        """sync_every="auto": why it chose what it chose ("" before it has chosen)."""
        return self._path.sync_every_reason

    @property
    def _exchange(self) -> GradientExchange | None:
        return self._path.planner.exchange

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """Parameter -> name, as Horovod's optimizer keeps it (scripts read it): the names of
        ``named_parameters``, else ``allreduce.noname.<group>.<position>``."""
        return dict(zip(self._path.params, self._path.names))

    @property
    def compression(self) -> Any:
        return self._path.planner.compression

    @property
    def auto_decision(self) -> Decision | None:
        """With ``compression="auto"``: the settled decision and its reason (None until then)."""
        comp = self.compression
        return comp.decision if isinstance(comp, AutoCompression) and comp.settled else None

    @property
    def hierarchical(self) -> bool:
        """Whether buckets are reduced hierarchically (known after the first step)."""
        exchange = self._path.planner.exchange
        return exchange is not None and exchange.hierarchical

    @property
    def streams(self) -> int:
        """Process groups the buckets travel on (known after the first step)."""
        return self._path.planner.streams

    @property
    def overlap(self) -> bool:
        """Whether step() overlaps the exchange with the next forward (overlap=True)."""
        return self._path.schedule is not None

    @property
    def shards_state(self) -> bool:
        """Whether this rank keeps only its shard of the optimizer state (shard_optimizer=True,
        a member of a process set of 2 or more ranks)."""
        return self._path.shards_state

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held on this rank (its shards, or the whole)."""
        return self._path.update.state_bytes

    @property
    def batch_shares(self) -> tuple[float, ...] | None:
        """The shares of the global batch now in force (None: equal, the plain average); with
        ``"auto"``, equal until the first measurement, then what it chose. Feed them to the
        data (:class:`ringtrain.elastic.share_sampler.ShareSampler`'s ``reset``)."""
        shares = self._path.reduction.shares
        return shares if isinstance(shares, tuple) else None

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's: communicate once every ``passes`` backward passes from now on, every
        gradient's count restarted (see ``GradientPath.set_passes``); alike on every rank."""
        self._path.set_passes(passes)

    def set_batch_shares(self, shares: Sequence[float]) -> None:
        """Weigh ranks by these shares from the next step on: call it between steps, with the
        same list on every rank (e.g. the samples each rank takes of a short last batch)."""
        self._path.set_batch_shares(shares)

    def drain(self) -> None:
        """Overlap: wait for the pending updates, so parameters and state are final."""
        self._path.drain()

    def remove_hooks(self) -> None:
        """Detach from the parameters; the optimizer then behaves like the plain one."""
        self._path.remove_hooks()

    # ---- Horovod's step --------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait for every gradient's reduction; parameters that got no gradient on this rank
        take part with zeros, so every rank runs the same collectives. With local updates
        (sync_every) gradients stay local: nothing to wait for."""
        if not self._path.update.exchanges():
            return
        self._path.synchronize()
        exchange = self._path.planner.exchange
        if exchange is not None and exchange.scatters:
            exchange.gather_grads()  # whole gradients, as synchronize() promises

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside skips synchronization, after an explicit ``synchronize()`` (e.g.
        to clip gradients on averaged values). Without it, ``step()`` after ``synchronize()``
        warns and reduces again, as Horovod's does."""
        path = self._path
        previous, path.skip_sync = path.skip_sync, True
        try:
            yield
        finally:
            path.skip_sync = previous

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating; the
        first backward pass after the block communicates the accumulated sum."""
        path = self._path
        previous, path.should_sync = path.should_sync, False
        try:
            yield
        finally:
            path.should_sync = previous

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        return self._path.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._path.zero_grad(set_to_none)


# Every DistributedOptimizer alive in this process, for the elastic rejoin.
_live: weakref.WeakSet[DistributedOptimizer] = weakref.WeakSet()


def rejoin_all() -> None:
    """Elastic: rebind every live DistributedOptimizer to the re-formed world."""
    for opt in list(_live):
        opt.rejoin()
