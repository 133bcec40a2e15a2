"""Horovod's ``RayExecutor`` on ringtrain: the same calls, ranks started as Ray actors.

    from ringtrain.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_hosts=2, num_workers_per_host=1, cpus_per_worker=1)
    executor.start()
    results = executor.run(train_fn, args=[...])   # train_fn calls hvd.init(); one result a rank
    executor.shutdown()

Fixed size: ``num_workers`` (packed), or ``num_hosts`` x ``num_workers_per_host`` (one bundle
per host, hosts strictly apart). Elastic: ``min_workers``/``max_workers`` start as many workers
as the cluster has free slots, up to ``max_workers``, at least ``min_workers``; a worker that
dies or fails is dropped and the survivors re-form the world in their own processes, exactly as
under ``ringtrain run --min-np`` (docs/elastic.md): this driver plays the launcher's part. It
serves the job's rendezvous store (``ringtrain.runtime.rendezvous_server``, a child process, so
rank 0 may die too) and announces each new world there through
:class:`ringtrain.launch.elastic.Membership`; the workers' ``@hvd.elastic.run`` does the rest.
The elastic ``run`` returns the results of the workers that finished, in their final rank order.

Not done here: growing onto slots that appear later (that is
:class:`ringtrain.ray.ElasticRayExecutor`, Horovod's Ray discovery, on this machinery); a
RayExecutor's elastic world only shrinks. ``cooldown_range`` is refused.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from ray.actor import ActorHandle
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import ray
from ray import ObjectRef
from ringtrain.errors import ConfigError, LaunchError, PeerFailedError
from ringtrain.launch import elastic as elastic_launch
from ringtrain.launch.plan import ProcessSpec
from ringtrain.launch.rendezvous import RendezvousServer
from ringtrain.ray import callbacks as worker_callbacks
from ringtrain.ray import placement
from ringtrain.ray.callbacks import Logged
from ringtrain.ray.worker import Worker
from ringtrain.security import keys

R = TypeVar("R")  # what a function run on the workers returns
log = logging.getLogger("ringtrain")


@dataclass
class Settings:
    """Horovod's ``MiniSettings``: ``timeout_s`` is ringtrain's collective and rendezvous
    timeout; ``nics`` the interfaces to use. The ssh fields are accepted and unused: ringtrain
    reaches Ray workers through Ray."""

    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    nics: set[str] | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    verbose: int = 1


class RayExecutor:
    """Job class for ringtrain on Ray, with Horovod's ``horovod.ray.RayExecutor`` API.

    ``ringtrain_settings``: any ringtrain setting by its Config name (``{"secure": True}``,
    ``{"network_interface": "eth0"}``); with ``secure`` and no ``key_file`` a fresh job key is
    made here and handed to each worker through a pipe (over Ray's connections: use Ray's TLS on
    untrusted networks).
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: set[str] | None = None,
    ) -> Settings:
        return Settings(
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            nics=nics,
            ssh_identity_file=ssh_identity_file,
            ssh_str=ssh_str,
        )

    def __init__(
        self,
        settings: Settings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: int | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: Sequence[int] | None = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
        *,
        ringtrain_settings: Mapping[str, object] | None = None,
    ) -> None:
        placement.check_counts(
            num_workers,
            num_hosts,
            num_workers_per_host,
            min_workers,
            max_workers,
            use_gpu,
            gpus_per_worker,
            cpus_per_worker,
        )
        if cooldown_range is not None:
            raise ConfigError(
                "cooldown_range is not supported by ringtrain's RayExecutor: an elastic job "
                "here only shrinks, so no host is ever taken back.\nHINT: leave it out."
            )
        self.settings = settings or Settings()
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.reset_limit = reset_limit
        self.elastic_timeout = elastic_timeout
        settings_ = dict(ringtrain_settings or {})
        settings_.setdefault("timeout_s", self.settings.timeout_s)
        if self.settings.nics:
            settings_.setdefault("network_interface", ",".join(sorted(self.settings.nics)))
        self._job = JobEnv(
            placement.settings_environment(settings_),
            secure=bool(settings_.get("secure")) and not settings_.get("key_file"),
        )
        self.workers: list[ActorHandle[Worker]] = []  # in rank order
        self._identities: list[int] = []  # each worker's elastic identity (its first rank)
        self._pg: PlacementGroup | None = None
        self._own_pg = False
        self._server: RendezvousServer | None = None
        self._membership: elastic_launch.Membership | None = None

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None

    # ---- start -------------------------------------------------------------------------------

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: Sequence[object] | None = None,
        executable_kwargs: Mapping[str, object] | None = None,
        extra_env_vars: Mapping[str, str] | None = None,
    ) -> None:
        """Start the workers (as Ray actors), give them their ranks and build ``executable_cls``
        in each. ``extra_env_vars`` are set in every worker first."""
        try:
            self._start(executable_cls, executable_args, executable_kwargs, extra_env_vars)
        except BaseException:
            self.shutdown()
            raise

    def _start(
        self,
        executable_cls: type | None,
        executable_args: Sequence[object] | None,
        executable_kwargs: Mapping[str, object] | None,
        extra_env_vars: Mapping[str, str] | None,
    ) -> None:
        bundles, strategy, per_bundle = self._bundles()
        self._pg, self._own_pg = self._placement_group(bundles, strategy)
        actors = [
            new_worker(
                self.cpus_per_worker,
                self.gpus_per_worker,
                PlacementGroupSchedulingStrategy(
                    self._pg,
                    placement_group_bundle_index=i // per_bundle if self._own_pg else -1,
                ),
            )
            for i in range(len(bundles) * per_bundle)
        ]
        reported: list[placement.WorkerFacts] = ray.get(
            [a.facts.remote() for a in actors], timeout=self.settings.timeout_s * 4
        )
        order = placement.host_major(reported)
        self.workers = [actors[i] for i in order]
        specs = placement.specs([reported[i] for i in order])
        self._server = RendezvousServer(sys.executable, self.settings.timeout_s * 20, 60.0)
        job = self._job
        job.extra = dict(extra_env_vars or {})
        job.addr, job.port = ray.util.get_node_ip_address(), self._server.port
        job.job_id = uuid.uuid4().hex[:16]
        job.key = keys.generate_job_key() if job.secure else None
        self._identities = list(range(len(specs)))
        if self.elastic:
            self._membership = elastic_launch.Membership(
                list(self._identities), min_np=self.min_workers or 1
            )
        envs = [self.rank_environment(spec, spec.rank) for spec in specs]
        ray.get([w.set_environment.remote(e, job.key) for w, e in zip(self.workers, envs)])
        ray.get(
            [
                w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                for w in self.workers
            ]
        )

    def rank_environment(
        self, spec: ProcessSpec, identity: int, join: bool = False
    ) -> dict[str, str]:
        """The environment of the worker placed at ``spec`` (elastic: ``identity``; ``join``:
        started to join the running job)."""
        job = self._job
        env = {**job.extra, **job.common}
        env.update(
            placement.rank_environment(spec, job.addr, job.port, job.job_id, store_hosted=True)
        )
        if self.elastic:
            env.update(
                elastic_launch.rank_env(
                    identity, self.elastic_timeout, self.reset_limit, join, self.min_workers or 1
                )
            )
        return env

    def _bundles(self) -> tuple[list[dict[str, float]], str, int]:
        """Placement group bundles, their strategy, and workers per bundle."""
        one = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            one["GPU"] = float(self.gpus_per_worker)
        if self.num_hosts:
            k = self.num_workers_per_host
            return [{r: v * k for r, v in one.items()}] * self.num_hosts, "STRICT_SPREAD", k
        if self.num_workers:
            return [one] * self.num_workers, "PACK", 1
        n = self._elastic_size()
        return [one] * n, "SPREAD", 1

    def _elastic_size(self) -> int:
        """Free slots now (up to max_workers); waits up to elastic_timeout for min_workers."""
        deadline = time.monotonic() + self.elastic_timeout
        while True:
            slots = sum(free_slots(self.cpus_per_worker, self.gpus_per_worker).values())
            if self.max_workers:
                slots = min(slots, self.max_workers)
            if slots >= (self.min_workers or 1):
                return slots
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the Ray cluster offers {slots} worker slot(s) of {self.cpus_per_worker} "
                    f"CPU(s), fewer than min_workers={self.min_workers}, after "
                    f"{self.elastic_timeout:g} s (elastic_timeout).\n"
                    "HINT: add nodes, lower cpus_per_worker or min_workers."
                )
            time.sleep(1.0)

    def _placement_group(
        self, bundles: list[dict[str, float]], strategy: str
    ) -> tuple[PlacementGroup, bool]:
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None and not self.elastic:
            log.info("ringtrain: using the current placement group for the workers")
            return current, False
        pg = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=self.settings.placement_group_timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise LaunchError(
                f"Ray could not place {len(bundles)} bundle(s) of {bundles[0]} ({strategy}) "
                f"within {self.settings.placement_group_timeout_s:g} s.\n"
                "HINT: check `ray status` for free CPUs/GPUs per node; lower cpus_per_worker or "
                "the worker count, or raise placement_group_timeout_s."
            )
        return pg, True

    # ---- run ---------------------------------------------------------------------------------

    def execute(self, fn: Callable[[Any], R], callbacks: Sequence[object] | None = None) -> list[R]:
        """``fn(executable)`` on every worker; the results in rank order. Each of ``callbacks``
        is called on the driver with every value rank 0 logs (:mod:`ringtrain.ray.ray_logger`)."""
        return self.call_all(fn, callbacks)

    def run(
        self,
        fn: Callable[..., R],
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        callbacks: Sequence[object] | None = None,
    ) -> list[R]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order. ``callbacks`` as
        for :meth:`execute`."""
        return self.call_all(Call(fn, list(args or []), dict(kwargs or {})), callbacks)

    def call_all(
        self,
        fn: Callable[[object], R],
        callbacks: Sequence[object] | None,
        growth: Callable[[Logged[R]], Callable[[dict[ObjectRef[R], int]], None]] | None = None,
    ) -> list[R]:
        """``fn(executable)`` on every worker, the values they log handed to ``callbacks``
        meanwhile; elastic: ``growth(call)`` makes :meth:`_collect`'s ``grow`` for the call."""
        chosen = worker_callbacks.checked(callbacks)
        workers = self._live()
        with contextlib.ExitStack() as stack:
            queue = stack.enter_context(worker_callbacks.Delivery(chosen)).queue if chosen else None
            call = Logged(fn, queue)
            grow = growth(call) if growth is not None else None
            return self._collect([call_on(w, call) for w in workers], grow=grow)

    def run_remote(
        self,
        fn: Callable[..., R],
        args: Sequence[object] | None = None,
        kwargs: Mapping[str, object] | None = None,
        callbacks: Sequence[object] | None = None,
    ) -> list[ObjectRef[R]]:
        """Like :meth:`run` without waiting: one ``ObjectRef`` per worker (fixed-size jobs)."""
        if callbacks:
            raise ConfigError(
                "run_remote does not wait for the run, so no callback could take the values "
                "the workers log (Horovod ignores them here).\nHINT: use run(fn, "
                "callbacks=[...]), or leave callbacks out."
            )
        if self.elastic:
            raise NotImplementedError(
                "run_remote is not available in elastic jobs: a worker may leave while it "
                "runs (as in Horovod). Use run()."
            )
        call = Call(fn, list(args or []), dict(kwargs or {}))
        return [call_on(w, call) for w in self._live()]

    def execute_single(self, fn: Callable[[Any], R]) -> R:
        """``fn(executable)`` on rank 0 only."""
        return ray.get(call_on(self._live()[0], fn))

    def _live(self) -> list[ActorHandle[Worker]]:
        if not self.workers:
            raise LaunchError("the executor has no workers.\nHINT: call start() first.")
        return self.workers

    def _collect(
        self,
        refs: list[ObjectRef[R]],
        grow: Callable[[dict[ObjectRef[R], int]], None] | None = None,
    ) -> list[R]:
        """The results of ``refs`` (one per worker, in rank order). Elastic: ``grow(pending)``
        is called about once a second and may add the refs of workers it started."""
        if not self.elastic:
            return _all_or_first_failure(refs)
        m = self._membership
        assert m is not None and self._server is not None
        pending = dict(zip(refs, self._identities))
        results: dict[int, R] = {}
        requests = elastic_launch.ReformRequests()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                ident = pending.pop(ref)
                try:
                    results[ident] = ray.get(ref)
                except Exception as e:  # the actor died, or fn raised: the rank failed
                    self._drop(ident, e, list(pending.values()))
            asked = requests.poll(m, self._server, time.monotonic(), finished=bool(results))
            if asked:
                log.warning(
                    "ringtrain: worker(s) %s failed a collective while no worker had left; the "
                    "same %d re-form as world %d",
                    asked,
                    len(m.members),
                    m.generation,
                )
            if grow is not None and pending:
                grow(pending)
        # Later calls go to the last world's workers, in its rank order.
        by_id = dict(zip(self._identities, self.workers))
        self._identities = list(m.members)
        self.workers = [by_id[i] for i in m.members]
        # The workers that finished, by their rank in the last world.
        return [results[i] for i in m.members if i in results]

    def _drop(self, ident: int, error: BaseException, running: list[int]) -> None:
        """A rank failed: announce the survivors' world, or end the job below min_workers."""
        m = self._membership
        assert m is not None and self._server is not None
        by_id = dict(zip(self._identities, self.workers))
        ray.kill(by_id[ident], no_restart=True)  # one that raised may still hold resources
        enough = m.lose(ident)
        first = (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]
        if not enough:
            for i in running:
                ray.kill(by_id[i], no_restart=True)
            raise LaunchError(
                f"worker {ident} failed ({type(error).__name__}: {first}) and fewer than "
                f"min_workers={m.min_np} remain ({len(m.members)} left).\n"
                "HINT: the cause is chained below; lower min_workers to go on with fewer."
            ) from error
        for k, v in m.announcement():
            self._server.publish(k, v)
        log.warning(
            "ringtrain: worker %d failed (%s: %s); the %d others go on as world %d",
            ident,
            type(error).__name__,
            first,
            len(m.members),
            m.generation,
        )

    # ---- stop --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """End the workers, their placement group and the rendezvous store."""
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self._pg is not None and self._own_pg:
            remove_placement_group(self._pg)
        self._pg = None
        if self._server is not None:
            self._server.close()
            self._server = None


@dataclass
class JobEnv:
    """What every worker of one job is given: ringtrain's settings (``common``), the caller's
    variables (``extra``), the job's store and, with ``secure``, its key (set by ``start``)."""

    common: dict[str, str]
    secure: bool
    extra: dict[str, str] = field(default_factory=dict)
    addr: str = ""
    port: int = 0
    job_id: str = ""
    key: bytes | None = None


def new_worker(cpus: float, gpus: float, strategy: object) -> ActorHandle[Worker]:
    """A :class:`Worker` actor with ``cpus``/``gpus``, scheduled by ``strategy``."""
    options = ray.remote(Worker).options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy)
    return cast("ActorHandle[Worker]", options.remote())


def call_on(worker: ActorHandle[Worker], fn: Callable[[Any], R]) -> ObjectRef[R]:
    """``worker.execute.remote(fn)``: ``fn(executable)`` on that worker, typed with what ``fn``
    returns (Ray's types carry no generic method's result type)."""
    return cast("ObjectRef[R]", worker.execute.remote(fn))


def free_slots(cpus_per_slot: float, gpus_per_slot: float) -> dict[str, int]:
    """Free worker slots of each alive Ray node, by node id (nodes with none left out)."""
    # HACK: Ray's public API has only the cluster-wide sum; slots are counted per node.
    from ray._private.state import available_resources_per_node

    per_node = available_resources_per_node()
    out = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        free = per_node.get(node["NodeID"], {})
        n = int(free.get("CPU", 0) // cpus_per_slot)
        if gpus_per_slot:
            n = min(n, int(free.get("GPU", 0) // gpus_per_slot))
        if n > 0:
            out[node["NodeID"]] = n
    return out


def _all_or_first_failure(refs: list[ObjectRef[R]]) -> list[R]:
    """Every worker's result, or, where some failed, the error of one that failed first: not
    a peer's that only says it left (a failing worker leaves the job, so every worker ends
    within seconds: ray/worker.py). Waiting for all of them leaves no run in flight."""
    ray.wait(refs, num_returns=len(refs))
    results: list[R] = []
    errors: list[Exception] = []
    for ref in refs:
        try:
            results.append(ray.get(ref))
        except Exception as e:
            errors.append(e)
    if errors:
        # A RayTaskError carries what the function raised as its cause.
        raise min(errors, key=lambda e: isinstance(getattr(e, "cause", e), PeerFailedError))
    return results


@dataclass(frozen=True)
class Call(Generic[R]):
    """``fn(*args, **kwargs)`` as an ``execute`` function (picklable, unlike a lambda's name)."""

    fn: Callable[..., R]
    args: list[object]
    kwargs: dict[str, object]

    def __call__(self, _executable: object) -> R:
        return self.fn(*self.args, **self.kwargs)
