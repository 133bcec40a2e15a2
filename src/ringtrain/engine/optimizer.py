"""DistributedOptimizer: average gradients across ranks while backward is still running.

It wraps the user's optimizer by composition. A hook on every trainable parameter fires once its
gradient is accumulated and tells the engine, which packs gradients into fusion buckets and
launches each bucket's allreduce as soon as the bucket is complete, on the process set's own
``engine`` group, without negotiating (see :mod:`ringtrain.engine.exchange`). ``step()`` waits
only for what is still in flight, then runs the wrapped optimizer.

The bucket plan is learned in the first step (see :mod:`ringtrain.engine.schedule`): that step
sends everything at ``step()``; later steps overlap backward. The plan is re-learned, on every
rank alike, when ``requires_grad`` of some parameter changes or a param group is added.

``shard_optimizer=True`` keeps and steps only this rank's 1/N of the optimizer state, then
all-gathers the parameters (ZeRO stage 1, :mod:`ringtrain.engine.sharded`). With ``overlap=True``
too, each bucket's shard steps and its parameters are all-gathered as the bucket's reduction
completes, on the overlap's updater thread, while the next forward runs.

Buckets travel round robin over ``engine_streams`` process groups, hierarchically when
``hierarchical`` says so (:mod:`ringtrain.engine.streams`); ``compression="auto"`` measures a few
steps and then picks the compression (:mod:`ringtrain.engine.auto`).

Limits, stated plainly: ``requires_grad`` must change identically on every rank and between
steps (as with DDP); ``ringtrain.join()`` does not stand in for the gradient exchange of a rank
that stopped training (use it for explicit collectives only); buckets of CUDA gradients travel
over Gloo.

The wrapper subclasses ``torch.optim.Optimizer`` (sharing ``param_groups`` and ``state`` with the
wrapped optimizer) only so that LR schedulers and ``isinstance`` checks accept it; it never runs
``Optimizer.__init__``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ringtrain.algorithms.hierarchical import prefer_hierarchical
from ringtrain.collectives import ops
from ringtrain.collectives.reduce_ops import resolve_op
from ringtrain.compression import resolve as resolve_compression
from ringtrain.compression.policy import AutoCompression, Decision
from ringtrain.diagnostics import engine_wait, timeline
from ringtrain.engine import buckets, schedule, sharded
from ringtrain.engine.auto import AutoTuner
from ringtrain.engine.buckets import ORDERS, Observation, Plan
from ringtrain.engine.exchange import Averaging, GradientExchange
from ringtrain.engine.overlap import (
    Overlap,
    bucket_groups,
    check_optimizer,
    launch_order,
    step_subset,
    steps_alike_by_bucket,
    timings,
)
from ringtrain.engine.streams import LanePool, Route
from ringtrain.errors import CollectiveArgumentError, ConfigError, InternalError
from ringtrain.runtime import state as runtime_state
from ringtrain.runtime.process_sets import ProcessSet

log = logging.getLogger("ringtrain")

# Horovod's words, which scripts filter on (warnings.filterwarnings): kept exactly.
_STEP_WITHOUT_SKIP = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)

# Key under which state_dict() keeps the compressor's state next to the optimizer's.
COMPRESSOR_STATE_KEY = "ringtrain_compressor"


class DistributedOptimizer(torch.optim.Optimizer):
    """Horovod's ``DistributedOptimizer``: same arguments, same behaviour, plus engine knobs.

    Args:
        optimizer: the optimizer to wrap (its ``param_groups`` and ``state`` are shared).
        named_parameters: ``model.named_parameters()``; names label buckets in errors and in the
            timeline. Without them, parameters get Horovod's names, ``allreduce.noname.<i>``,
            ``i`` counting through ``optimizer.param_groups`` (see :meth:`_index_names`). Every
            rank must pass the same parameters in the same order.
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
        process_set: reduce over this process set instead of the world.
        sparse_as_dense: send sparse gradients as dense tensors instead of as (indices, values).
        groups, num_groups: accepted for Horovod scripts and ignored, with a warning: the engine
            groups gradients into buckets itself.
        fusion_threshold_bytes, cycle_time_ms, bucket_order: bucket planning (see
            :mod:`ringtrain.engine.buckets` for the tuning guide).
        hierarchical: "auto", "on" or "off": reduce buckets hierarchically (within hosts, then
            across; world process set, plain and 16-bit buckets only).
        engine_streams: process groups the buckets use round robin (world process set only).
        reproducible: False lets timing shape the buckets (cuts at gaps in backward); see
            docs/engine.md, "Reproducibility".
        link_class: "auto" (measured in the first step), "fast" or "slow": sets the bucket size.
        shard_optimizer: True steps the optimizer sharded (ZeRO stage 1): each rank keeps and
            updates the optimizer state of 1/N of every bucket, then the updated parameters
            are all-gathered (:mod:`ringtrain.engine.sharded`). ``state_dict()`` then gathers
            the full state and is collective: every rank must call it.
        reduce_scatter: with ``shard_optimizer``, reduce-scatter the gradients instead of
            allreducing them: each rank receives the sum of its own shard only, so a sharded
            step moves an allreduce's bytes in all, not 1.5 times them. Sums follow a ring's
            order (not the unsharded engine's, so weights differ from it in the last bits),
            and outside this rank's shard ``.grad`` keeps this rank's own gradient after
            ``step()``; ``synchronize()`` all-gathers the reduced gradients when you call it
            (to clip them, say). Combines with every codec, transport, ``overlap`` and
            ``hierarchical`` (docs/engine.md, "One gradient path"): a codec that cannot be cut
            (PowerSGD, top-k) and the hierarchical allreduce reduce whole buckets, and the
            sharded step takes its shard after.
        overlap: True: ``step()`` returns once the buckets are launched, each bucket's parameters
            are updated as its reduction completes, and the next forward waits per module for
            its own parameters (:mod:`ringtrain.engine.overlap`; contract in docs/engine.md).
            Combines with ``shard_optimizer``: the all-gathers then overlap the next forward.

    Settings left as None come from :class:`ringtrain.config.Config` (``RINGTRAIN_*``
    variables, which ``ringtrain run`` flags set), then the defaults: arguments win.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        compression: Any = None,
        backward_passes_per_step: int = 1,
        op: Any = None,
        gradient_predivide_factor: float = 1.0,
        process_set: ProcessSet | None = None,
        sparse_as_dense: bool = False,
        average_aggregated_gradients: bool = False,
        groups: Any = None,
        num_groups: int = 0,
        *,
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
        if backward_passes_per_step < 1:
            raise ConfigError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
            )
        if gradient_predivide_factor <= 0:
            raise ConfigError(
                f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}"
            )
        if groups is not None or num_groups:
            warnings.warn(
                "DistributedOptimizer(groups=/num_groups=) is ignored: ringtrain plans buckets itself "
                "(see fusion_threshold_bytes, cycle_time_ms, bucket_order)",
                stacklevel=2,
            )
        self.optimizer = optimizer
        # Names are checked before anything needs init(), as in Horovod.
        self._params: list[torch.nn.Parameter] = []
        self._names: list[str] = []
        self._index_names(named_parameters)
        self._op = resolve_op(op)
        if self._op not in ("Average", "Sum"):
            raise ConfigError(f"DistributedOptimizer supports op=Average or Sum, got {self._op}")
        if gradient_predivide_factor != 1.0 and self._op != "Average":
            raise ConfigError("gradient_predivide_factor needs op=Average")
        if process_set is not None and not process_set.included():
            # Outside its set the optimizer only steps on local gradients (Horovod's behaviour).
            config = runtime_state.current().config
            self._comm = process_set.communicator
        else:
            controller = ops.controller_of(process_set)
            config = controller.config
            self._comm = controller.comm
        self._size = self._comm.size
        self._threshold = (
            config.fusion_threshold_bytes
            if fusion_threshold_bytes is None
            else fusion_threshold_bytes
        )
        self._cycle_time_ms = config.cycle_time_ms if cycle_time_ms is None else cycle_time_ms
        self._order = config.bucket_order if bucket_order is None else bucket_order
        if self._threshold < 0:
            raise ConfigError(f"fusion_threshold_bytes must be >= 0, got {self._threshold}")
        if self._cycle_time_ms <= 0:
            raise ConfigError(f"cycle_time_ms must be > 0, got {self._cycle_time_ms}")
        if self._order not in ORDERS:
            raise ConfigError(
                f"bucket_order must be one of {', '.join(ORDERS)}, got {self._order!r}"
            )
        self._hierarchical = config.hierarchical if hierarchical is None else hierarchical
        if self._hierarchical not in ("auto", "on", "off"):
            raise ConfigError(
                f"hierarchical must be 'auto', 'on' or 'off', got {self._hierarchical!r}\n"
                "HINT: 'auto' decides from the placement of the ranks on hosts."
            )
        self._reproducible = config.reproducible if reproducible is None else reproducible
        link_class = config.link_class if link_class is None else link_class
        if link_class not in buckets.LINK_CLASSES:
            raise ConfigError(
                f"link_class must be one of {', '.join(buckets.LINK_CLASSES)}, got {link_class!r}"
            )
        # The link class that sizes buckets: pinned, or measured in the first step (then fixed).
        self._link_class: str | None = None if link_class == "auto" else link_class
        self._link_pinned = self._link_class  # what an elastic rejoin() starts from again
        self._streams = config.engine_streams if engine_streams is None else engine_streams
        if self._streams < 1:
            raise ConfigError(f"engine_streams must be >= 1, got {self._streams}")
        self._timeout_s = config.timeout_s
        self._shard_mode = config.shard_optimizer if shard_optimizer is None else shard_optimizer
        if self._shard_mode:
            sharded.check_supported(optimizer)
        self._scatter = config.reduce_scatter if reduce_scatter is None else reduce_scatter
        self._shards: sharded.ShardedStep | None = None
        self._updater_group: Any = None  # overlap: the updater thread's own collectives
        self._compression_arg = config.compression if compression is None else compression
        self._compression = resolve_compression(self._compression_arg, config)
        if self._scatter:
            self._check_scatter()
        self._tuner: AutoTuner | None = None
        if (
            isinstance(self._compression, AutoCompression)
            and self._size > 1
            and self._comm.included
        ):
            self._tuner = AutoTuner(
                self._compression, self._comm.group("engine"), self._size, self._comm.set_rank
            )
        self._lanes: list[Route] | None = None
        self._last_sync_end = 0.0
        self._process_set = process_set
        self.backward_passes_per_step = backward_passes_per_step
        self._average_aggregated = average_aggregated_gradients
        self._predivide = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._sparse_back: set[int] = set()  # sparse gradients sent dense, handed back sparse
        self._hooks: dict[int, Any] = {}
        # Dropped without remove_hooks(), the optimizer takes its hooks off the parameters.
        weakref.finalize(self, _remove_hooks, self._hooks)
        self._plan: Plan | None = None
        self._observed: list[Observation] = []  # every rank's, from the last learning step
        self._exchange: GradientExchange | None = None
        self._counts = [0] * len(self._params)
        self._learner: schedule.Learner | None = None
        self._step_open = False  # a hook fired since the last synchronize
        self._learning = False  # this step learns the bucket plan
        self._any_ready = False  # some gradient reached backward_passes_per_step
        self._in_pass = False  # timeline only: inside a backward pass
        self._pass_start = 0.0
        self._synchronized = False  # synchronize() ran since the last step()
        self._should_sync = True
        self._skip_sync = False  # inside skip_synchronize()
        self._syncs = 0  # synchronize() calls: the step number the wait watch posts
        self._watch = self._make_watch(config.stall_warning_s)
        # Cross-iteration overlap (opt-in): the pending updates, and the agreed launch order.
        self._overlap: Overlap | None = None
        self._launch_order: list[int] | None = None
        self._overlap_open = False  # an overlapped step() ran and no gradient came since
        if config.overlap if overlap is None else overlap:
            if self._shard_mode and not self._comm.is_world and self._size > 1:
                raise ConfigError(
                    "overlap=True with shard_optimizer=True works on the world process set only "
                    f"(this optimizer is on process set {self._comm.set_id}): its all-gathers "
                    "need a process group of their own.\n"
                    "HINT: drop one of overlap and shard_optimizer on this process set."
                )
            check_optimizer(optimizer)
            if self._size > 1 and self._comm.included:
                self._overlap = Overlap(optimizer, self._timeout_s)
                weakref.finalize(self, self._overlap.close)
        self._register_hooks()
        _live.add(self)

    def _check_scatter(self) -> None:
        """reduce_scatter=True: what it needs, as errors that say what to change."""
        if not self._shard_mode:
            raise ConfigError(
                "reduce_scatter=True needs shard_optimizer=True: each rank then steps only the "
                "shard whose sum it receives.\nHINT: add shard_optimizer=True, or drop "
                "reduce_scatter."
            )

    def rejoin(self) -> None:
        """Elastic: the world was re-formed (:mod:`ringtrain.elastic`); take its communicator and
        start over alike on every rank: the bucket plan is learned again, compression state
        (PowerSGD/top-k error feedback, the auto tuner) starts afresh, and a measured link class
        is measured again. Called for every live optimizer by ``@elastic.run``."""
        if self._process_set not in (None, runtime_state.global_process_set):
            return  # its process set is gone with the old world; it cannot be used again
        controller = ops.controller_of(self._process_set)
        config = controller.config
        with contextlib.suppress(Exception):  # the old world's failure, already reported
            self._drain()
        self._overlap_open = False
        self._drop_plan()
        self._comm = controller.comm
        self._size = self._comm.size
        self._compression = resolve_compression(self._compression_arg, config)
        self._tuner = None
        if isinstance(self._compression, AutoCompression) and self._size > 1:
            self._tuner = AutoTuner(
                self._compression, self._comm.group("engine"), self._size, self._comm.set_rank
            )
        self._link_class = self._link_pinned
        self._lanes = None
        self._updater_group = None
        self._shards = None  # the old world's shards: a restored (full) state is sharded anew
        self._observed = []
        self._counts = [0] * len(self._params)
        self._learner = None
        self._step_open = self._learning = self._any_ready = self._in_pass = False
        self._synchronized = False
        self._should_sync = True
        if self._watch is not None:
            self._watch.close()
        self._watch = self._make_watch(config.stall_warning_s)
        if self._size == 1:
            _remove_hooks(self._hooks)
        else:
            self._register_hooks()

    # ---- the torch.optim.Optimizer surface, delegated ----------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict, plus the compressor's state (if it has any)
        under ``"ringtrain_compressor"``. A stateful compressor's state can differ per rank
        (e.g. PowerSGD's error feedback): save every rank's to resume it exactly."""
        self._drain()
        sd = self._full_state_dict() if self._shards is not None else self.optimizer.state_dict()
        get = getattr(self._compression, "state_dict", None)
        comp_state = get() if callable(get) else {}
        if comp_state:
            sd[COMPRESSOR_STATE_KEY] = {
                "name": getattr(self._compression, "name", type(self._compression).__name__),
                "state": comp_state,
            }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._drain()
        sd = dict(state_dict)
        saved = sd.pop(COMPRESSOR_STATE_KEY, None)
        self.optimizer.load_state_dict(sd)
        if self._shards is not None:
            self._absorb_full_state()
        if saved is None:
            return
        mine = getattr(self._compression, "name", type(self._compression).__name__)
        if saved.get("name") != mine:
            raise ConfigError(
                f"the state_dict holds state of compressor {saved.get('name')!r}, but this "
                f"optimizer uses {mine!r}.\nHINT: resume with the compression you saved with."
            )
        load = getattr(self._compression, "load_state_dict", None)
        if callable(load):
            load(saved["state"])
        if self._tuner is not None:
            self._tuner.restored()
        if self._exchange is not None:
            self._build_exchange()  # the compressor may have changed (auto)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._drain()
        self.optimizer.add_param_group(param_group)
        self._index_names(None)
        self._counts = [0] * len(self._params)
        self._drop_plan()
        self._register_hooks()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "DistributedOptimizer cannot be pickled; save optimizer.state_dict() instead"
        )

    # ---- introspection (tests, benchmarks, timeline) ------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The agreed bucket plan; None until the first step."""
        return self._plan

    @property
    def _parameter_names(self) -> dict[torch.nn.Parameter, str]:
        """Parameter -> name, as Horovod's optimizer keeps it (scripts read it): the names of
        ``named_parameters``, else ``allreduce.noname.<i>``."""
        return dict(zip(self._params, self._names))

    @property
    def compression(self) -> Any:
        return self._compression

    @property
    def auto_decision(self) -> Decision | None:
        """With ``compression="auto"``: the settled decision and its reason (None until then)."""
        comp = self._compression
        return comp.decision if isinstance(comp, AutoCompression) and comp.settled else None

    @property
    def hierarchical(self) -> bool:
        """Whether buckets are reduced hierarchically (known after the first step)."""
        return self._exchange is not None and self._exchange.hierarchical

    @property
    def lanes(self) -> int:
        """Process groups the buckets travel on (known after the first step)."""
        return len(self._lanes) if self._lanes else 0

    # ---- naming and hooks --------------------------------------------------------------------

    def _index_names(self, named: Iterable[tuple[str, torch.nn.Parameter]] | None) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        old = dict(zip(self._params, self._names))
        if named is not None:
            pairs = list(named)
            if any(not isinstance(p, tuple) or len(p) != 2 for p in pairs):
                raise ConfigError(
                    "named_parameters must be an iterable of (name, parameter), "
                    "e.g. model.named_parameters()"
                )
            names = [n for n, _ in pairs]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ConfigError(f"named_parameters has duplicate names: {dupes}")
            by_param = {p: n for n, p in pairs}
            missing = [i for i, p in enumerate(params) if p not in by_param]
            if missing:
                raise ConfigError(
                    f"{len(missing)} optimizer parameter(s) are not in named_parameters "
                    f"(positions {missing[:5]}).\nHINT: pass the named_parameters() of the model "
                    "whose parameters the optimizer holds."
                )
            old = by_param
        self._params = params
        # Horovod's names (horovod/torch/optimizer.py): allreduce.noname.<i>. Horovod restarts
        # i in each param group, so several groups give duplicates and its constructor raises;
        # counting on through the groups keeps group 0's names and makes later ones unique.
        unnamed = {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
        self._names = [old.get(p, unnamed[p]) for p in params]

    def _make_watch(self, warning_s: float) -> engine_wait.WaitWatch | None:
        """Names the ranks elsewhere when synchronize() waits past the stall warning time.
        Keyed by the parameter names, which every rank's optimizer of one model shares."""
        comm = self._comm
        if self._size == 1 or not comm.included or comm.store is None or warning_s <= 0:
            return None
        names = zlib.crc32("\n".join(self._names).encode())
        watch = engine_wait.WaitWatch(
            comm.store,
            f"ringtrain/engine/set{comm.set_id}/{names:08x}",
            comm.ranks[comm.set_rank],
            comm.ranks,
            warning_s,
            self._timeout_s,
        )
        weakref.finalize(self, watch.close)
        return watch

    def _register_hooks(self) -> None:
        if self._size == 1 or not self._comm.included:
            # Nothing to exchange at world size 1; outside its process set the optimizer steps
            # on local gradients, as Horovod's does.
            return
        me = weakref.ref(self)
        for i, p in enumerate(self._params):
            if p.requires_grad and i not in self._hooks:
                self._hooks[i] = p.register_post_accumulate_grad_hook(
                    functools.partial(_grad_ready, me, i)
                )

    def remove_hooks(self) -> None:
        """Detach from the parameters; the optimizer then behaves like the plain one."""
        self._drain()
        _remove_hooks(self._hooks)
        self._drop_plan()

    def _drop_plan(self) -> None:
        if self._exchange is not None:
            self._exchange.close()
        self._exchange = None
        self._plan = None
        self._launch_order = None

    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        if self._overlap is not None and self._overlap_open:
            # The previous step's updates end before this step's buckets reuse the exchange.
            self._overlap_open = False
            self._overlap.forward_ended()
            self._overlap.drain()
        if not self._should_sync:
            return
        if not self._step_open:
            self._open_step()
        rec = timeline.current()
        if rec.enabled and not self._in_pass:
            self._start_pass()
        n = self._counts[index] + 1
        if n > self.backward_passes_per_step:
            raise CollectiveArgumentError(
                f"gradient of {self._names[index]!r} was computed again before step().\n"
                "HINT: call optimizer.step() (or synchronize()) between backward passes, or set "
                "backward_passes_per_step to the number of backward passes per step."
            )
        self._counts[index] = n
        if n < self.backward_passes_per_step:
            return
        self._any_ready = True
        grad = param.grad
        if self._sparse_as_dense and grad is not None and grad.is_sparse:
            self._sparse_back.add(index)
        if self._learning:
            assert self._learner is not None
            self._learner.saw(index, grad is not None and grad.is_sparse)
        else:
            assert self._exchange is not None
            self._exchange.ready(index)

    def _open_step(self) -> None:
        """First gradient of a step: decide whether this step learns the plan. Every rank
        decides alike, from its own parameters, before anything is sent."""
        self._step_open = True
        plan = self._plan
        self._learning = plan is None or plan.trainable != schedule.trainable_of(self._params)
        if self._learning:
            self._learner = schedule.Learner(len(self._params))

    def _start_pass(self) -> None:
        self._in_pass = True
        self._pass_start = time.perf_counter()
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        except RuntimeError:  # not inside a backward pass (a hook fired by hand)
            self._in_pass = False

    def _end_pass(self) -> None:
        self._in_pass = False
        timeline.current().span("compute", "BACKWARD", self._pass_start, time.perf_counter())

    # ---- communication -----------------------------------------------------------------------

    def _scaling(self) -> Averaging:
        k = self.backward_passes_per_step if self._average_aggregated else 1
        return Averaging(self._op == "Average", self._size, self._predivide, 1.0 / k)

    def _make_plan(self) -> None:
        """The learning step's end: agree on a plan with every rank, build its buffers."""
        rec = timeline.current()
        t0 = time.perf_counter()
        learner = self._learner or schedule.Learner(len(self._params))
        observation = learner.observation(self._params)
        if self._sparse_as_dense:
            observation = dataclasses.replace(
                observation, sparse=tuple(False for _ in self._params)
            )
        self._observed = schedule.gather(observation, self._comm.group("engine"), self._size)
        plan = self._agree(buckets.MIN_TIMED_BUCKET_BYTES)
        self._drop_plan()
        self._plan = plan
        if self._lanes is None:
            self._lanes = self._make_lanes()
            if self._overlap is not None and self._comm.is_world:
                # The updater thread's collectives (the sharded step's all-gathers, a 16-bit
                # bucket's full-precision redo) get a group of their own: on the engine groups
                # they could interleave differently on each rank with the collectives the main
                # thread launches there (another optimizer's buckets). One updater thread
                # serves every optimizer, so their order on this group is the same everywhere.
                pool = LanePool.of(self._comm, self._timeout_s)
                self._updater_group = pool.spare("overlap-updater")
        self._build_exchange()
        self._register_hooks()
        log.debug("ringtrain bucket plan %s: %s", plan.digest, plan.describe())
        rec.span("step", "PLAN", t0, time.perf_counter(), {"plan": plan.describe()})

    def _agree(self, min_timed_bytes: int) -> Plan:
        threshold, cycle_ms = self._threshold, self._cycle_time_ms
        if self._reproducible:
            # Sizes and the ready order only; until the class is known, plan for a fast link.
            threshold = min(threshold, buckets.CLASS_BUCKET_BYTES[self._link_class or "fast"])
            cycle_ms = 0.0
        return buckets.agree(
            schedule.specs_of(self._params, self._names),
            self._observed,
            threshold_bytes=threshold,
            cycle_time_ms=cycle_ms,
            order=self._order,
            min_timed_bytes=min_timed_bytes,
        )

    def _calibrate(self) -> None:
        """The learning step's end: its exchange sent every bucket at once with nothing else
        running, so it measured the rate gradients move at (the slowest rank's, so every rank
        holds the same figure). Reproducible: that rate picks the link class once, and with it
        the bucket size. Otherwise: every rank re-plans alike with the bucket floor the rate
        calls for (see ``buckets.timed_floor``)."""
        plan, exchange = self._plan, self._exchange
        if plan is None or exchange is None or not plan.buckets:
            return
        if self._reproducible and self._link_class is not None:
            return  # pinned, or measured by an earlier learning step: the plan is final
        nbytes = sum(b.nbytes for b in plan.buckets)
        rate = schedule.agree_rate(
            nbytes, exchange.last_comm_s, self._comm.group("engine"), self._size
        )
        if self._reproducible:
            self._link_class = buckets.link_class(rate)
            better = self._agree(buckets.MIN_TIMED_BUCKET_BYTES)
        else:
            better = self._agree(buckets.timed_floor(rate, self._threshold))
        if better.digest != plan.digest:
            self._plan = plan = better
            self._build_exchange()
        if self._comm.set_rank != 0:
            return
        if self._reproducible:
            log.info(
                "ringtrain: gradients moved at %.0f MB/s: link class %r, %s. Every run that "
                "measures this class sums alike; pin it with RINGTRAIN_LINK_CLASS=%s%s",
                rate / 1e6,
                self._link_class,
                plan.describe(),
                self._link_class,
                " (the rate is near the class boundary: pin it)"
                if buckets.borderline(rate)
                else "",
            )
        else:
            log.info(
                "ringtrain: gradients moved at %.0f MB/s: buckets closed at timed gaps "
                "(reproducible=False); %s",
                rate / 1e6,
                plan.describe(),
            )

    def _compressor(self) -> Any:
        """The compressor in use: the one given, or what auto currently uses."""
        comp = self._compression
        return comp.inner if isinstance(comp, AutoCompression) else comp

    def _build_exchange(self) -> None:
        assert self._plan is not None and self._lanes is not None
        if self._exchange is not None:
            self._exchange.close()
        self._exchange = GradientExchange(
            self._plan,
            self._params,
            self._names,
            self._lanes,
            self._compressor(),
            self._scaling(),
            scatter=self._scatter and self.shards_state,
            scatter_groups=self._scatter_groups(),
        )
        self._exchange.measure = self._tuner is not None and self._tuner.active
        if self._launch_order is not None:
            self._exchange.set_launch_order(self._launch_order)

    def _scatter_groups(self) -> list[Any] | None:
        """Where CUDA buckets are reduce-scattered: the set's CUDA group (NCCL, or host memory
        where NCCL cannot serve: see ``Communicator.group_for``). Collective the first time,
        at a plan every rank builds alike. None: the lanes' groups."""
        if not (self._scatter and self.shards_state):
            return None
        cuda = next((p for p in self._params if p.device.type == "cuda"), None)
        return None if cuda is None else [self._comm.group_for(cuda.detach()[:0])]

    def _plan_overlap(self, busy_s: float) -> None:
        """The learning step's end, with overlap: agree on the link rate (the slowest rank's)
        and derive the launch order from it, alike on every rank (see overlap.launch_order)."""
        plan, exchange = self._plan, self._exchange
        if plan is None or exchange is None or not plan.buckets:
            return
        nbytes = sum(b.nbytes for b in plan.buckets)
        rate = schedule.agree_rate(nbytes, busy_s, self._comm.group("engine"), self._size)
        self._launch_order = launch_order(timings(plan, self._observed[0]), rate)
        exchange.set_launch_order(self._launch_order)
        log.debug("ringtrain overlap: launch order %s at %.0f MB/s", self._launch_order, rate / 1e6)

    def _drain(self) -> None:
        """Overlap: wait for the pending updates, so parameters and state are final."""
        if self._overlap is not None:
            self._overlap.drain()

    def _make_lanes(self) -> list[Route]:
        """The groups buckets travel on. Collective (it may make groups): called at the first
        plan, which every rank of the process set reaches alike."""
        engine = [Route(self._comm.group("engine"))]
        if not self._comm.is_world:
            if self._streams > 1 or self._hierarchical == "on":
                log.info(
                    "engine_streams and hierarchical apply to the world process set only; "
                    "process set %d uses its engine group",
                    self._comm.set_id,
                )
            return engine
        hosts = runtime_state.current().topology.hosts
        # reduce_scatter with hierarchical="auto" stays flat: the ring reduce-scatters, where the
        # hierarchical allreduce would reduce whole buckets and take the shard after ("on").
        flat = self._scatter and self._shard_mode and self._hierarchical == "auto"
        hier = not flat and prefer_hierarchical(hosts, self._hierarchical)
        if hier and self._comm.set_rank == 0:
            log.info(
                "ringtrain: hierarchical allreduce (hierarchical=%s): gradients are summed within "
                "each host first, so results differ from a flat run's and from other host layouts",
                self._hierarchical,
            )
        if self._streams == 1 and not hier:
            return engine
        return LanePool.of(self._comm, self._timeout_s).lanes(
            self._streams, hosts if hier else None
        )

    def synchronize(self) -> None:
        """Wait for every gradient's reduction; parameters that got no gradient on this rank
        take part with zeros, so every rank runs the same collectives."""
        self._synchronize()
        if self._exchange is not None and self._exchange.scatters:
            self._exchange.gather_grads()  # whole gradients, as synchronize() promises

    def _synchronize(self, then: Callable[[int], None] | None = None) -> None:
        """:meth:`synchronize`; ``then(s)`` runs as soon as bucket ``s`` is reduced (when the
        step is not a learning step: see :meth:`_bucket_updates`)."""
        self._drain()
        if self._overlap_open and not self._step_open:
            # After an overlapped step() and no backward since: the updates are final now.
            self._overlap_open = False
            return
        if self._size == 1:
            if self._average_aggregated and self.backward_passes_per_step > 1:
                with torch.no_grad():
                    for p in self._params:
                        if p.grad is not None:
                            p.grad.div_(self.backward_passes_per_step)
            self._synchronized = True
            return
        if not self._comm.included:
            self._synchronized = True  # not a member: nothing to reduce (Horovod's behaviour)
            return
        rec = timeline.current()
        observer = self._comm.service("step_timer")
        t0 = time.perf_counter()
        if observer is not None:
            observer.wait_started()
        learning = False
        try:
            if not self._step_open:
                self._open_step()
            learning = self._learning
            if self._learning:
                self._make_plan()
            assert self._exchange is not None
            self._syncs += 1
            if self._watch is not None:
                self._watch.begin(self._syncs)
            if learning:
                self._exchange.measure = True  # for _calibrate
            if self._sparse_as_dense:
                self._sparse_back.update(
                    i for i, p in enumerate(self._params) if p.grad is not None and p.grad.is_sparse
                )
            try:
                with torch.no_grad():
                    self._exchange.flush()
                    self._exchange.finish(None if learning else then)
                    self._resparsify()
            finally:
                if self._watch is not None:
                    self._watch.end()
            if learning:
                busy_s = self._exchange.last_comm_s
                self._calibrate()
                if self._overlap is not None:
                    self._plan_overlap(busy_s)
                self._exchange.measure = self._tuner is not None and self._tuner.active
        finally:
            self._counts = [0] * len(self._params)
            self._sparse_back.clear()
            self._step_open = self._learning = self._any_ready = False
            self._in_pass = False  # a backward that raised never ran its end callback
            self._learner = None
            if self._exchange is not None:
                self._exchange.reset()
        t1 = time.perf_counter()
        if self._tuner is not None and self._tuner.active:
            self._observe(learning, t0, t1)
        if observer is not None:
            observer.wait_done()
        rec.span("step", "SYNCHRONIZE", t0, t1)
        self._synchronized = True

    def _resparsify(self) -> None:
        """sparse_as_dense: a gradient that came in sparse goes back sparse (as in Horovod), so
        optimizers that only take sparse gradients (SparseAdam) still step."""
        for i in self._sparse_back:
            p = self._params[i]
            if p.grad is not None and not p.grad.is_sparse:
                p.grad = p.grad.to_sparse()

    def _observe(self, learning: bool, t0: float, t1: float) -> None:
        """compression="auto": hand the step's timings to the tuner (collective at a phase's
        end), and rebuild the exchange when it switched compressors."""
        assert self._tuner is not None and self._exchange is not None and self._plan is not None
        previous, self._last_sync_end = self._last_sync_end, t1
        if learning or previous == 0.0:
            return  # the learning step sent everything at step(): its timings mean nothing here
        if self._tuner.observe(t0 - previous, t1 - t0, self._exchange.last_comm_s, self._plan):
            self._build_exchange()
        else:
            self._exchange.measure = self._tuner.active
        self._last_sync_end = time.perf_counter()  # the decision's own collectives are not compute

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside skips synchronization, after an explicit ``synchronize()`` (e.g.
        to clip gradients on averaged values). Without it, ``step()`` after ``synchronize()``
        warns and reduces again, as Horovod's does."""
        previous, self._skip_sync = self._skip_sync, True
        try:
            yield
        finally:
            self._skip_sync = previous

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without communicating; the
        first backward pass after the block communicates the accumulated sum."""
        previous, self._should_sync = self._should_sync, False
        try:
            yield
        finally:
            self._should_sync = previous

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        self._drain()
        self._overlap_open = False
        if self._should_sync and not self._skip_sync:
            if self._synchronized:
                warnings.warn(_STEP_WITHOUT_SKIP, stacklevel=2)
            if self._step_open and not self._any_ready:
                raise CollectiveArgumentError(
                    f"step() after {max(self._counts)} of {self.backward_passes_per_step} "
                    "backward passes.\nHINT: call step() once every backward_passes_per_step passes."
                )
            if self._overlapping(closure):
                return self._step_overlapped()
            updates = self._bucket_updates(closure)
            if updates is not None:
                self._synchronize(updates.update)
                if updates.finish():
                    return self._step_done(None)
            else:
                self._synchronize()  # reduce_scatter: the step needs this rank's shard alone
        self._synchronized = False
        rec = timeline.current()
        t0 = time.perf_counter()
        result: Any = None
        if self.shards_state and self._plan is not None:
            self._sharded_step(closure)
        else:
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        rec.span("step", "OPTIMIZER_STEP", t0, time.perf_counter())
        return self._step_done(result)

    def _bucket_updates(self, closure: Any) -> _BucketUpdates | None:
        """The optimizer's update, bucket by bucket, for a step() that synchronizes: each
        bucket's parameters are updated as soon as its reduction is done, while later buckets
        are still on the wire, instead of all of them after the last one. The same computation
        as one ``optimizer.step()`` (per-parameter optimizers only, the sums untouched), so the
        weights are bit for bit the same; None where that does not hold or cannot be known yet
        (the learning step, a closure, sparse gradients, the sharded step, compression="auto",
        step hooks)."""
        if (
            closure is not None
            or self._size == 1
            or not self._comm.included
            or self.shards_state
            or self._tuner is not None
            or self._sparse_as_dense
            or not steps_alike_by_bucket(self.optimizer)
        ):
            return None
        if not self._step_open:
            self._open_step()  # decides, as synchronize() would, whether this step learns
        if self._learning or self._exchange is None or self._plan is None or self._plan.sparse:
            return None
        return _BucketUpdates(self.optimizer, self._exchange, self._comm.service("step_timer"))

    def _step_done(self, result: Any) -> Any:
        self._synchronized = False
        observer = self._comm.service("step_timer")
        if observer is not None:
            observer.step_done()
        return result

    # ---- the sharded step (shard_optimizer=True; ringtrain.engine.sharded) -------------------

    @property
    def shards_state(self) -> bool:
        """Whether this rank keeps only its shard of the optimizer state (shard_optimizer=True,
        a member of a process set of 2 or more ranks)."""
        return bool(self._shard_mode) and self._size > 1 and self._comm.included

    @property
    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held on this rank (its shards, or the whole)."""
        total = self._shards.state_bytes() if self._shards is not None else 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def _sharded_step(self, closure: Callable[[], float] | None) -> None:
        if closure is not None:
            raise ConfigError(
                "step(closure) is not supported with shard_optimizer=True.\n"
                "HINT: compute the loss before step(), or use shard_optimizer=False."
            )
        self._current_shards().step()

    def _current_shards(self) -> sharded.ShardedStep:
        """The shards of the current plan, holding all of the optimizer's state. Collective
        when the plan is new (every rank reaches it at the same step)."""
        plan = self._plan
        assert plan is not None
        if self._shards is None or self._shards.plan.digest != plan.digest:
            # A new plan cuts new shards: carry the state over (collective, like the plan).
            full = self._shards.gather_state() if self._shards is not None else {}
            self._shards = sharded.ShardedStep(
                plan,
                self._params,
                self._names,
                self.optimizer,
                self._comm.group("engine"),
                self._comm.set_rank,
                self._size,
            )
            if full:
                self._shards.load_state(full)
        self._absorb_full_state()
        return self._shards

    def _absorb_full_state(self) -> None:
        """Full state in the wrapped optimizer (loaded, broadcast, or from a step before the
        first plan) goes into the shards, and leaves the wrapped optimizer."""
        assert self._shards is not None
        inner = self.optimizer.state
        full = {i: dict(inner[p]) for i, p in enumerate(self._params) if inner.get(p)}
        if full:
            self._shards.load_state(full)
        inner.clear()

    def _full_state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict with the full state gathered from every rank's
        shards (collective), so it loads into a sharded or an unsharded optimizer alike."""
        assert self._shards is not None
        inner = self.optimizer
        full = self._shards.gather_state()
        saved = inner.state
        state: collections.defaultdict[Any, dict[str, Any]] = collections.defaultdict(dict)
        state.update({self._params[i]: st for i, st in full.items()})
        state.update({p: st for p, st in saved.items() if st})  # not absorbed yet: newer
        inner.state = state
        try:
            return inner.state_dict()
        finally:
            inner.state = saved

    def _overlapping(self, closure: Any) -> bool:
        """Whether this step() overlaps: overlap is on, the plan is learned and unchanged, and
        there is no closure (which must see the updated parameters at once)."""
        if self._overlap is None or closure is not None or not self._comm.included:
            return False
        if not self._step_open:
            self._open_step()  # decides, as synchronize() would, whether this step learns
        if self._learning or self._exchange is None or self._plan is None:
            return False
        if self._tuner is not None and self._tuner.active:
            return False  # compression="auto" times whole steps: it measures without overlap
        if self._plan.sparse:
            raise ConfigError(
                "overlap=True needs dense gradients, but "
                f"{', '.join(self._names[i] for i in self._plan.sparse)} came sparse.\n"
                "HINT: pass sparse_as_dense=True, or overlap=False."
            )
        return self._launch_order is not None

    def _step_overlapped(self) -> None:
        """Launch what is left and hand the waiting and the per-bucket updates to the updater
        thread: the parameters are updated by the time they are next used (see overlap)."""
        exchange = self._exchange
        assert exchange is not None and self._overlap is not None
        rec = timeline.current()
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                exchange.flush()
        finally:
            self._counts = [0] * len(self._params)
            self._sparse_back.clear()  # dense in overlap: gradients stay as they travelled
            self._step_open = self._learning = self._any_ready = False
            self._in_pass = False
            self._learner = None
        self._syncs += 1
        n = len(self._plan.buckets) if self._plan is not None else 0
        update: Callable[[int], None] | None = None
        if self.shards_state:
            # Each bucket: this rank's shard steps, then the bucket's parameters are
            # all-gathered; a module's forward waits for its own bucket's gather only.
            shards = self._current_shards()
            # The hyper-parameters as at step(): a scheduler may change them before the update.
            update = functools.partial(
                shards.step_bucket, settings=shards.hyper_parameters(), group=self._updater_group
            )
        self._overlap.start(
            self._launch_order or list(range(n)),
            [exchange.members(s) for s in range(n)],
            functools.partial(exchange.finish_slot, redo_group=self._updater_group),
            exchange.reset,
            update,
        )
        self._overlap_open = True
        self._synchronized = False
        rec.span("step", "STEP_LAUNCHED", t0, time.perf_counter())
        observer = self._comm.service("step_timer")
        if observer is not None:
            observer.step_done()

    @property
    def overlap(self) -> bool:
        """Whether step() overlaps the exchange with the next forward (overlap=True)."""
        return self._overlap is not None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._any_ready:
            raise CollectiveArgumentError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize().\nHINT: this is usually a missing optimizer.step()."
            )
        if self._overlap is not None and self._overlap.pending:
            # Deferred per bucket, so the next forward need not wait for the whole exchange.
            self._overlap.zero_grad(self._params, set_to_none)
            return
        self.optimizer.zero_grad(set_to_none=set_to_none)


class _BucketUpdates:
    """One step's updates bucket by bucket (:meth:`DistributedOptimizer._bucket_updates`)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, exchange: GradientExchange, timer: Any = None
    ) -> None:
        self._optimizer = optimizer
        self._timer = timer  # straggler reports: an update is compute, not waiting
        members = [exchange.members(s) for s in range(len(exchange.plan.buckets))]
        # The hyper-parameters as at step(), as one optimizer.step() would read them.
        self._groups = bucket_groups(optimizer, members)
        self._done = [False] * len(members)
        in_buckets = {id(p) for m in members for p in m}
        self._rest = [
            p
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) not in in_buckets
        ]

    def update(self, s: int) -> None:
        if self._timer is not None:
            self._timer.wait_done()
        t0 = time.perf_counter()
        step_subset(self._optimizer, self._groups[s])
        self._done[s] = True
        if self._timer is not None:
            self._timer.wait_started()
        timeline.current().span("update", "OPTIMIZER_STEP", t0, time.perf_counter(), {"bucket": s})

    def finish(self) -> bool:
        """After the exchange: whether every bucket was updated (if not, none was: the caller
        steps the optimizer as a whole). Parameters outside every bucket step now."""
        if not all(self._done):
            if any(self._done):
                raise InternalError("the step updated some buckets and not others")
            return False
        rest = [p for p in self._rest if p.grad is not None]
        if rest:
            step_subset(self._optimizer, bucket_groups(self._optimizer, [rest])[0])
        return True


def _grad_ready(optimizer: weakref.ref[DistributedOptimizer], index: int, param: Any) -> None:
    """A parameter's hook. It holds its optimizer weakly: hooks live in the parameter's C++
    autograd data, out of sight of Python's garbage collector, so a strong reference would make
    optimizer -> parameters -> hook -> optimizer a cycle that is never freed, and a dropped
    optimizer would keep its reducer threads and buffers for the life of the process."""
    opt = optimizer()
    if opt is not None:
        opt._on_grad_ready(index, param)


# Every DistributedOptimizer alive in this process, for the elastic rejoin.
_live: weakref.WeakSet[DistributedOptimizer] = weakref.WeakSet()


def rejoin_all() -> None:
    """Elastic: rebind every live DistributedOptimizer to the re-formed world."""
    for opt in list(_live):
        opt.rejoin()


def _remove_hooks(hooks: dict[int, Any]) -> None:
    for h in hooks.values():
        h.remove()
    hooks.clear()
