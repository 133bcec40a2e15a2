"""Horovod's ``ElasticRayExecutor`` on ringtrain: an elastic job on a Ray cluster that shrinks
when a worker dies and grows when slots free up.

    from ringtrain.ray import ElasticRayExecutor

    settings = ElasticRayExecutor.create_settings(min_np=2, max_np=4)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)
    executor.start()                       # as many workers as free slots, up to max_np
    results = executor.run(train_fn)       # train_fn(): hvd.init(); @hvd.elastic.run ...

It is :class:`ringtrain.ray.RayExecutor`'s elastic job (``min_workers``/``max_workers``: a
worker that dies is dropped and the survivors re-form the world in their own processes) with
Ray-node discovery on top: while ``run`` waits, the driver counts the free slots of the alive
Ray nodes about once a second; when the world is below ``max_np`` it starts new worker actors
on those nodes (pinned to the node), each runs ``worker_fn`` and its ``hvd.init()`` joins the
running job; once they are ready the driver announces the grown world in the job's store, and
the running ranks take it at their next ``state.commit()`` (or ``check_host_updates``) and
re-form in place, as under ``ringtrain run --host-discovery-script`` (docs/elastic.md).
``run`` returns the results of the workers of the last world, in rank order, and ends the job's
workers (one ``run`` per ``start``, as in Horovod).

Not done: a user-supplied discovery (``override_discovery=False``) and ``cooldown_range``
(ringtrain never blacklists a node); each is refused with a ``ConfigError`` naming it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic

from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import ray
from ray import ObjectRef
from ringtrain.errors import ConfigError
from ringtrain.launch import elastic as elastic_launch
from ringtrain.ray import placement
from ringtrain.ray.callbacks import Logged
from ringtrain.ray.executor import (
    Call,
    R,
    RayExecutor,
    Settings,
    call_on,
    free_slots,
    new_worker,
)
from ringtrain.ray.worker import Worker

log = logging.getLogger("ringtrain")
POLL_S = 1.0  # how often the driver looks for free slots while the world is below max_np


@dataclass
class ElasticSettings:
    """Horovod's ``ElasticSettings`` for Ray: the fields ringtrain reads."""

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    nics: set[str] | None = None
    ssh_identity_file: str | None = None
    verbose: int = 1


def create_settings(
    min_np: int | None = None,
    max_np: int | None = None,
    reset_limit: int | None = None,
    elastic_timeout: float = 600,
    timeout_s: float = 30,
    ssh_identity_file: str | None = None,
    nics: set[str] | None = None,
    cooldown_range: object = None,
    *,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    verbose: int = 1,
    **kwargs: object,
) -> ElasticSettings:
    """Horovod's ``ElasticRayExecutor.create_settings`` (``min_np``/``max_np`` or their newer
    spellings ``min_num_proc``/``max_num_proc``)."""
    if cooldown_range is not None:
        raise ConfigError(
            "cooldown_range is not supported by ringtrain's ElasticRayExecutor: it never "
            "blacklists a node, so there is no cooldown to set.\nHINT: leave it out."
        )
    if kwargs:
        raise ConfigError(
            f"ElasticRayExecutor.create_settings got settings ringtrain does not know: "
            f"{sorted(kwargs)}.\nHINT: ringtrain settings go in ElasticRayExecutor(..., "
            "ringtrain_settings={...})."
        )
    for old, new in (("min_np", min_np), ("max_np", max_np)):
        if new is not None and (min_num_proc if old == "min_np" else max_num_proc) is not None:
            raise ConfigError(f"{old} and its newer spelling {old[:4]}num_proc were both given")
    low = min_num_proc if min_num_proc is not None else (min_np if min_np is not None else 1)
    high = max_num_proc if max_num_proc is not None else max_np
    return ElasticSettings(
        min_num_proc=low,
        max_num_proc=high,
        reset_limit=reset_limit,
        elastic_timeout=elastic_timeout,
        timeout_s=timeout_s,
        nics=nics,
        ssh_identity_file=ssh_identity_file,
        verbose=verbose,
    )


class ElasticRayExecutor:
    """Elastic ringtrain job on Ray, with Horovod's ``horovod.ray.ElasticRayExecutor`` API.

    ``env_vars`` are set in every worker before ``worker_fn`` runs; ``ringtrain_settings`` as
    for :class:`RayExecutor`.
    """

    create_settings = staticmethod(create_settings)

    def __init__(
        self,
        settings: ElasticSettings,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: int | None = None,
        env_vars: Mapping[str, str] | None = None,
        override_discovery: bool = True,
        *,
        ringtrain_settings: Mapping[str, object] | None = None,
    ) -> None:
        if not override_discovery:
            raise ConfigError(
                "override_discovery=False (a discovery of your own in settings) is not "
                "supported by ringtrain's ElasticRayExecutor: it discovers Ray nodes itself.\n"
                "HINT: leave override_discovery at True; for a host discovery script use "
                "`ringtrain run --host-discovery-script`."
            )
        low, high = settings.min_num_proc, settings.max_num_proc
        if low < 1 or (high is not None and high < low):
            raise ConfigError(f"need 1 <= min_np <= max_np, got min_np={low}, max_np={high}")
        if gpus_per_slot and not use_gpu:
            raise ConfigError(
                "gpus_per_slot is set, but use_gpu is False.\nHINT: pass use_gpu=True as well."
            )
        self.settings = settings
        self.env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        self._executor = RayExecutor(
            Settings(
                timeout_s=settings.timeout_s,
                nics=settings.nics,
                ssh_identity_file=settings.ssh_identity_file,
                verbose=settings.verbose,
            ),
            cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_slot,
            min_workers=settings.min_num_proc,
            max_workers=settings.max_num_proc,
            reset_limit=settings.reset_limit,
            elastic_timeout=settings.elastic_timeout,
            ringtrain_settings=ringtrain_settings,
        )

    def start(self) -> None:
        """Start as many workers as the cluster has free slots (up to ``max_np``; waits up to
        ``elastic_timeout`` for ``min_np``) and the job's rendezvous store."""
        self._executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], R], callbacks: Sequence[object] | None = None) -> list[R]:
        """``worker_fn()`` on every worker, and on every worker started later; the results of
        the last world's workers in rank order. The workers are ended afterwards. Each of
        ``callbacks`` is called on the driver with every value the rank 0 of the moment logs
        (:mod:`ringtrain.ray.ray_logger`)."""
        ex = self._executor
        try:
            return ex.call_all(
                Call(worker_fn, [], {}), callbacks, growth=lambda call: _Growth(ex, call).tick
            )
        finally:
            ex.shutdown()

    def shutdown(self) -> None:
        """End the workers and the store (``run`` does this itself)."""
        self._executor.shutdown()


class _Growth(Generic[R]):
    """The driver's discovery while ``run`` waits: start workers on free slots, admit them."""

    def __init__(self, executor: RayExecutor, call: Logged[R]) -> None:
        self.ex = executor
        self.call = call
        self.starting: dict[
            ObjectRef[placement.WorkerFacts], ActorHandle[Worker]
        ] = {}  # facts ref -> actor, not yet placed
        self.joining: dict[int, float] = {}  # identity -> ready by (monotonic)
        self.next_id = max(executor._identities, default=-1) + 1
        self.next_poll = time.monotonic() + POLL_S

    def tick(self, pending: dict[ObjectRef[R], int]) -> None:
        running = set(pending.values())
        for i in [i for i in self.joining if i not in running]:  # failed before it joined
            del self.joining[i]
        self._place(pending)
        self._admit()
        now = time.monotonic()
        if now >= self.next_poll and not self.starting:
            self.next_poll = now + POLL_S
            self._discover()

    def _room(self) -> int:
        m = self.ex._membership
        assert m is not None
        high = self.ex.max_workers
        if high is None:
            return 1 << 30
        return high - len(m.members) - len(self.joining) - len(self.starting)

    def _discover(self) -> None:
        room = self._room()
        if room <= 0:
            return
        ex = self.ex
        for node_id, n in free_slots(ex.cpus_per_worker, ex.gpus_per_worker).items():
            for _ in range(min(n, room)):
                actor = new_worker(
                    ex.cpus_per_worker,
                    ex.gpus_per_worker,
                    NodeAffinitySchedulingStrategy(node_id, soft=False),
                )
                self.starting[actor.facts.remote()] = actor
                room -= 1
            if room <= 0:
                break

    def _place(self, pending: dict[ObjectRef[R], int]) -> None:
        """Workers that reported their node get their ranks and start ``worker_fn``."""
        if not self.starting:
            return
        ready, _ = ray.wait(list(self.starting), num_returns=len(self.starting), timeout=0)
        new: list[tuple[ActorHandle[Worker], placement.WorkerFacts]] = []
        for ref in ready:
            actor = self.starting.pop(ref)
            try:
                new.append((actor, ray.get(ref)))
            except Exception as e:  # the actor died while starting: no slot after all
                log.warning("ringtrain: a worker started to join failed to start: %s", e)
                ray.kill(actor, no_restart=True)
        if not new:
            return
        ex, m = self.ex, self.ex._membership
        assert m is not None
        order = placement.host_major([f for _, f in new])
        before = len(m.members) + len(self.joining)
        size = before + len(new)
        for spec in placement.specs([new[i][1] for i in order]):
            actor = new[order[spec.rank]][0]
            ident, self.next_id = self.next_id, self.next_id + 1
            spec = dataclasses.replace(spec, rank=before + spec.rank, size=size)
            env = ex.rank_environment(spec, ident, join=True)
            ray.get(actor.set_environment.remote(env, ex._job.key))
            pending[call_on(actor, self.call)] = ident
            ex.workers.append(actor)
            ex._identities.append(ident)
            self.joining[ident] = time.monotonic() + ex.elastic_timeout
        log.warning("ringtrain: %d worker(s) started on free slots to join the job", len(new))

    def _admit(self) -> None:
        """Joiners that are ready enter one new world together; late ones are given up."""
        if not self.joining:
            return
        ex, m = self.ex, self.ex._membership
        assert m is not None and ex._server is not None
        now = time.monotonic()
        by_id = dict(zip(ex._identities, ex.workers))
        for i in [i for i, by in self.joining.items() if by < now]:
            log.warning("ringtrain: worker %d was not ready to join in time; ending it", i)
            ray.kill(by_id[i], no_restart=True)  # its run fails and is dropped
            del self.joining[i]
        have = ex._server.present([elastic_launch.ready_key(i) for i in self.joining])
        ready = [i for i in self.joining if elastic_launch.ready_key(i) in have]
        if not ready or len(m.members) + len(ready) < m.min_np:
            return
        for i in ready:
            del self.joining[i]
        m.add(*ready)
        for k, v in m.announcement():
            ex._server.publish(k, v)
        log.warning(
            "ringtrain: worker(s) %s joined: the world grows to %d (generation %d)",
            ready,
            len(m.members),
            m.generation,
        )
