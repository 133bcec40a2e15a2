"""The bucket plan of one DistributedOptimizer and the exchange built on it.

The first step *learns* (:mod:`ringtrain.engine.schedule`): it sends everything at
``synchronize()``, every rank gathers every rank's observation, and all agree on one plan
(:func:`ringtrain.engine.buckets.agree`). The learning step's exchange also measures the rate
gradients move at, which fixes the bucket size (``reproducible``) or the timed floor, and, with
overlap, the launch order. The plan is learned again, alike on every rank, when ``requires_grad``
of some parameter changes or a param group is added. ``compression="auto"`` hands each step's
timings to its tuner here, and the exchange is rebuilt when it switches compressors.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringtrain.compression import resolve as resolve_compression
from ringtrain.compression.policy import AutoCompression
from ringtrain.config import Config
from ringtrain.diagnostics import timeline
from ringtrain.engine import buckets, schedule
from ringtrain.engine.auto import AutoTuner
from ringtrain.engine.buckets import Observation, Plan
from ringtrain.engine.exchange import GradientExchange
from ringtrain.engine.overlap import check_dense, launch_order, timings
from ringtrain.engine.streams import Route, StreamPool
from ringtrain.engine.weighting import Averaging
from ringtrain.errors import ConfigError
from ringtrain.runtime import abort
from ringtrain.runtime import state as runtime_state
from ringtrain.transport.hierarchical import prefer_hierarchical

log = logging.getLogger("ringtrain")

# The engine settings every rank's optimizer must share (engine/same_settings.py).
_SHARED_FIELDS = (
    "fusion_threshold_bytes", "cycle_time_ms", "bucket_order", "compression", "powersgd_rank",
    "powersgd_start_step", "topk_ratio", "hierarchical", "engine_streams", "reproducible",
    "link_class", "shard_optimizer", "reduce_scatter", "overlap", "sync_every",
    "outer_compression", "outer_overlap", "outer_delay", "outer_fragments", "batch_shares",
)  # fmt: skip


class Planner:
    """Learns and keeps the bucket plan, its streams and its :class:`GradientExchange`."""

    def __init__(
        self,
        comm: Any,
        config: Config,
        compression: Any,
        overlap: bool,
    ) -> None:
        self.comm = comm
        self._config = config
        self._overlap = overlap  # overlapped steps: the updater thread gets a group of its own
        self.compression_arg = compression
        # The link class that sizes buckets: pinned, or measured in the first step (then fixed).
        self._link_class: str | None = None
        self.scatter = False  # reduce-scatter buckets (the sharded step with reduce_scatter)
        self._params: list[torch.nn.Parameter] = []
        self._names: list[str] = []
        self.plan: Plan | None = None
        self.exchange: GradientExchange | None = None
        self.learner: schedule.Learner | None = None  # set while a step learns the plan
        self.updater_group: Any = None  # overlap: the updater thread's own collectives
        self._observed: list[Observation] = []  # every rank's, from the last learning step
        self._routes: list[Route] | None = None
        self._launch_order: list[int] | None = None
        self._last_sync_end = 0.0
        self.compression: Any = None
        self.tuner: AutoTuner | None = None
        self._trial = False  # the step now ending was one the tuner observed (compression_in_use)
        self.rebind(comm, config)

    def rebind(self, comm: Any, config: Config) -> None:
        """Start over on ``comm`` (construction, and an elastic rejoin): nothing learned is
        kept, compression state (error feedback, the auto tuner) starts afresh, resolved from
        ``config`` (the job's); the engine settings stay those the optimizer was made with."""
        self.drop_plan()
        self.comm = comm
        link_class = self._config.link_class
        self._link_class = None if link_class == "auto" else link_class
        self.compression = resolve_compression(self.compression_arg, config)
        self.tuner = None
        if isinstance(self.compression, AutoCompression) and comm.size > 1 and comm.included:
            self.tuner = AutoTuner(
                self.compression,
                comm.group("engine"),
                comm.size,
                comm.set_rank,
            )
        self._routes = None
        self.updater_group = None
        self._observed = []
        self.learner = None

    def set_params(self, params: Sequence[torch.nn.Parameter], names: Sequence[str]) -> None:
        self._params, self._names = list(params), list(names)

    @property
    def size(self) -> int:
        return int(self.comm.size)

    @property
    def learning(self) -> bool:
        return self.learner is not None

    @property
    def launch_order(self) -> list[int] | None:
        """Overlap's agreed launch order (None until the learning step's end)."""
        return self._launch_order

    @property
    def streams(self) -> int:
        return len(self._routes) if self._routes else 0

    def open_step(self) -> None:
        """First gradient of a step: decide whether this step learns the plan. Every rank
        decides alike, from its own parameters, before anything is sent."""
        plan = self.plan
        if plan is None or plan.trainable != schedule.trainable_of(self._params):
            self.learner = schedule.Learner(len(self._params))

    def drop_plan(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
        self.exchange = None
        self.plan = None
        self._launch_order = None

    def compressor(self) -> Any:
        """The compressor in use: the one given, or what auto currently uses."""
        comp = self.compression
        return comp.inner if isinstance(comp, AutoCompression) else comp

    def compression_in_use(self) -> tuple[str, bool]:
        """(the compression of the step now ending, as the straggler report names it; whether
        it was one of compression="auto"'s measuring or trying steps, alike on every rank),
        for the report, which leaves those steps out and does not offer what is in use."""
        trial, self._trial = self._trial, False
        comp = self.compression
        if isinstance(comp, AutoCompression):
            return f"{comp.choice or 'none'} (chosen by compression='auto')", trial
        return str(getattr(comp, "name", "") or type(comp).__name__), trial

    # ---- learning ------------------------------------------------------------------------------

    def make_plan(self, sparse_as_dense: bool, averaging: Averaging) -> None:
        """The learning step's end: agree on a plan with every rank, build its buffers."""
        rec = timeline.current()
        t0 = time.perf_counter()
        learner = self.learner or schedule.Learner(len(self._params))
        observation = learner.observation(self._params)
        if sparse_as_dense:
            observation = dataclasses.replace(
                observation, sparse=tuple(False for _ in self._params)
            )
        settings = self._shared_settings(averaging, sparse_as_dense)
        self._observed = schedule.gather(
            observation, self.comm.group("engine"), self.size, settings
        )
        plan = self._agree(buckets.MIN_TIMED_BUCKET_BYTES)
        if self._overlap:
            check_dense(plan, self._names)  # agreed alike: every rank refuses, nothing reduced
        self.drop_plan()
        self.plan = plan
        if self._routes is None:
            self._routes = self._make_routes()
            if self._overlap and self.comm.is_world:
                # The updater thread's collectives (the sharded step's all-gathers, a 16-bit
                # bucket's full-precision redo) get a group of their own: on the engine groups
                # they could interleave differently on each rank with the collectives the main
                # thread launches there (another optimizer's buckets). One updater thread
                # serves every optimizer, so their order on this group is the same everywhere.
                pool = StreamPool.of(self.comm, self._config.timeout_s)
                self.updater_group = pool.spare("overlap-updater")
        self.build_exchange(averaging)
        log.debug("ringtrain bucket plan %s: %s", plan.digest, plan.describe())
        rec.span("step", "PLAN", t0, time.perf_counter(), {"plan": plan.describe()})

    def _shared_settings(self, averaging: Averaging, sparse_as_dense: bool) -> dict[str, str]:
        """What every rank's optimizer must share, as text (:mod:`.same_settings`): not a
        rank's ``batch_shares`` weight, which is its own."""
        out = {name: str(getattr(self._config, name)) for name in _SHARED_FIELDS}
        out["op"] = "Average" if averaging.average else "Sum"
        out["gradient_predivide_factor"] = repr(averaging.predivide)
        out["backward_passes_per_step (averaged)"] = repr(averaging.k_scale)
        arg = self.compression_arg  # a name, or a compressor class or object (Horovod's)
        given = arg if isinstance(arg, str) else getattr(arg, "__name__", type(arg).__name__)
        out["compression (as given)"] = given
        out["sparse_as_dense"] = str(sparse_as_dense)
        return out

    def learned(self, averaging: Averaging) -> None:
        """After the learning step's exchange: fix the bucket size and the launch order."""
        assert self.exchange is not None
        busy_s = self.exchange.last_comm_s
        self._calibrate(averaging)
        if self._overlap:
            self._plan_overlap(busy_s)
        self.exchange.measure = self.tuner is not None and self.tuner.active

    def _agree(self, min_timed_bytes: int) -> Plan:
        config = self._config
        threshold, cycle_ms = config.fusion_threshold_bytes, config.cycle_time_ms
        if config.reproducible:
            # Sizes and the ready order only; until the class is known, plan for a fast link.
            threshold = min(threshold, buckets.CLASS_BUCKET_BYTES[self._link_class or "fast"])
            cycle_ms = 0.0
        return buckets.agree(
            schedule.specs_of(self._params, self._names),
            self._observed,
            threshold_bytes=threshold,
            cycle_time_ms=cycle_ms,
            order=config.bucket_order,
            min_timed_bytes=min_timed_bytes,
        )

    def _calibrate(self, averaging: Averaging) -> None:
        """The learning step's end: its exchange sent every bucket at once with nothing else
        running, so it measured the rate gradients move at (the slowest rank's, so every rank
        holds the same figure). Reproducible: that rate picks the link class once, and with it
        the bucket size. Otherwise: every rank re-plans alike with the bucket floor the rate
        calls for (see ``buckets.timed_floor``)."""
        plan, exchange = self.plan, self.exchange
        if plan is None or exchange is None or not plan.buckets:
            return
        reproducible = self._config.reproducible
        if reproducible and self._link_class is not None:
            return  # pinned, or measured by an earlier learning step: the plan is final
        nbytes = sum(b.nbytes for b in plan.buckets)
        rate = schedule.agree_rate(
            nbytes, exchange.last_comm_s, self.comm.group("engine"), self.size
        )
        if reproducible:
            self._link_class = buckets.link_class(rate)
            better = self._agree(buckets.MIN_TIMED_BUCKET_BYTES)
        else:
            better = self._agree(buckets.timed_floor(rate, self._config.fusion_threshold_bytes))
        if better.digest != plan.digest:
            self.plan = plan = better
            self.build_exchange(averaging)
        if self.comm.set_rank != 0:
            return
        if reproducible:
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

    def _plan_overlap(self, busy_s: float) -> None:
        """The learning step's end, with overlap: agree on the link rate (the slowest rank's)
        and derive the launch order from it, alike on every rank (see overlap.launch_order)."""
        plan, exchange = self.plan, self.exchange
        if plan is None or exchange is None or not plan.buckets:
            return
        nbytes = sum(b.nbytes for b in plan.buckets)
        rate = schedule.agree_rate(nbytes, busy_s, self.comm.group("engine"), self.size)
        self._launch_order = launch_order(timings(plan, self._observed[0]), rate)
        exchange.set_launch_order(self._launch_order)
        log.debug("ringtrain overlap: launch order %s at %.0f MB/s", self._launch_order, rate / 1e6)

    # ---- the exchange --------------------------------------------------------------------------

    def build_exchange(self, averaging: Averaging) -> None:
        assert self.plan is not None and self._routes is not None
        if self.exchange is not None:
            self.exchange.close()
        self.exchange = GradientExchange(
            self.plan,
            self._params,
            self._names,
            self._routes,
            self.compressor(),
            averaging,
            scatter=self.scatter,
            scatter_groups=self._scatter_groups(),
        )
        self.exchange.measure = self.tuner is not None and self.tuner.active
        if self._launch_order is not None:
            self.exchange.set_launch_order(self._launch_order)

    def _scatter_groups(self) -> list[Any] | None:
        """Where CUDA buckets are reduce-scattered: the set's CUDA group (NCCL, or host memory
        where NCCL cannot serve: see ``Communicator.group_for``). Collective the first time,
        at a plan every rank builds alike. None: the streams' groups."""
        if not self.scatter:
            return None
        cuda = next((p for p in self._params if p.device.type == "cuda"), None)
        return None if cuda is None else [self.comm.group_for(cuda.detach()[:0])]

    def _make_routes(self) -> list[Route]:
        """The groups buckets travel on. Collective (it may make groups): called at the first
        plan, which every rank of the process set reaches alike."""
        config = self._config
        engine = [Route(self.comm.group("engine"))]
        if not self.comm.is_world:
            if config.engine_streams > 1 or config.hierarchical == "on":
                log.info(
                    "engine_streams and hierarchical apply to the world process set only; "
                    "process set %d uses its engine group",
                    self.comm.set_id,
                )
            return engine
        hosts = runtime_state.current().topology.hosts
        # reduce_scatter with hierarchical="auto" stays flat: the ring reduce-scatters, where the
        # hierarchical allreduce would reduce whole buckets and take the shard after ("on").
        flat = self.scatter and config.hierarchical == "auto"
        hier = not flat and prefer_hierarchical(hosts, config.hierarchical)
        if hier and self.comm.set_rank == 0:
            log.info(
                "ringtrain: hierarchical allreduce (hierarchical=%s): gradients are summed within "
                "each host first, so results differ from a flat run's and from other host layouts",
                config.hierarchical,
            )
        if config.engine_streams == 1 and not hier:
            return engine
        return StreamPool.of(self.comm, config.timeout_s).streams(
            config.engine_streams, hosts if hier else None
        )

    def observe(self, learning: bool, t0: float, t1: float, averaging: Averaging) -> None:
        """compression="auto": hand the step's timings to the tuner (collective at a phase's
        end), and rebuild the exchange when it switched compressors."""
        if self.tuner is None or not self.tuner.active:
            return
        self._trial = True
        assert self.exchange is not None and self.plan is not None
        previous, self._last_sync_end = self._last_sync_end, t1
        if learning or previous == 0.0:
            return  # the learning step sent everything at step(): its timings mean nothing here
        if self.tuner.observe(t0 - previous, t1 - t0, self.exchange.last_comm_s, self.plan):
            self.build_exchange(averaging)
        else:
            self.exchange.measure = self.tuner.active
        self._last_sync_end = time.perf_counter()  # the decision's own collectives are not compute

    # ---- one step's exchange -------------------------------------------------------------------

    def run(
        self,
        then: Callable[[int], None] | None,
        averaging: Averaging,
        sparse_back: set[int] | None,
        watch: Any,
        step: int,
        on_plan: Callable[[], None],
    ) -> None:
        """Reduce this step's gradients (learning the plan first if this step learns it).
        ``then(s)`` runs as bucket ``s`` is reduced (not in a learning step); ``sparse_back``
        (``sparse_as_dense``) collects the gradients that came sparse, which go back sparse."""
        learning = self.learning
        # Watched from the first collective on: a learning step's plan is agreed in one, where
        # a rank not yet at its first step keeps the others waiting as in any later step.
        if watch is not None:
            watch.begin(step)
        # Past the stall shutdown time, a wait that some ranks never joined ends (sliced waits).
        stop = watch.check if watch is not None and watch.shutdown_s > 0 else None
        try:
            with abort.stopping(stop):
                if learning:
                    self.make_plan(sparse_back is not None, averaging)
                    on_plan()
            exchange = self.exchange
            assert exchange is not None
            if learning:
                exchange.measure = True  # for _calibrate
            if sparse_back is not None:
                sparse_back.update(
                    i for i, p in enumerate(self._params) if p.grad is not None and p.grad.is_sparse
                )
            with torch.no_grad(), abort.stopping(stop):
                exchange.flush()
                exchange.finish(None if learning else then)
                # A gradient that came in sparse goes back sparse (as in Horovod), so optimizers
                # that only take sparse gradients (SparseAdam) still step.
                for i in sparse_back or ():
                    p = self._params[i]
                    if p.grad is not None and not p.grad.is_sparse:
                        p.grad = p.grad.to_sparse()
        except RuntimeError as e:
            named = watch.failed(e) if watch is not None else e
            if named is e:
                raise
            raise named from e
        finally:
            if watch is not None:
                watch.end()
        if learning:
            self.learned(averaging)

    def step_ended(self) -> None:
        self.learner = None
        if self.exchange is not None:
            self.exchange.reset()

    # ---- the compressor's state (state_dict) ---------------------------------------------------

    def compressor_state(self) -> dict[str, Any] | None:
        """``{"name", "state"}`` of a stateful compressor (error feedback), else None."""
        comp = self.compression
        get = getattr(comp, "state_dict", None)
        state = get() if callable(get) else {}
        if not state:
            return None
        return {"name": getattr(comp, "name", type(comp).__name__), "state": state}

    def load_compressor_state(self, saved: dict[str, Any], averaging: Averaging) -> None:
        comp = self.compression
        mine = getattr(comp, "name", type(comp).__name__)
        if saved.get("name") != mine:
            raise ConfigError(
                f"the state_dict holds state of compressor {saved.get('name')!r}, but this "
                f"optimizer uses {mine!r}.\nHINT: resume with the compression you saved with."
            )
        load = getattr(comp, "load_state_dict", None)
        if callable(load):
            load(saved["state"])
        if self.tuner is not None:
            self.tuner.restored()
        if self.exchange is not None:
            self.build_exchange(averaging)  # the compressor may have changed (auto)
