"""Cross-iteration overlap: the next forward runs while the last buckets are still on the wire.

Opt-in (``DistributedOptimizer(overlap=True)``, ``RINGTRAIN_OVERLAP=1``). Without it, ``step()``
waits for every bucket and then runs the whole optimizer, so on a slow link the next forward
starts only once the last byte arrived. With it, ``step()`` launches what is left and returns;
an updater thread waits for the buckets in launch order and, as each one's reduction completes,
runs the wrapped optimizer over that bucket's parameters alone (:func:`step_subset`: the same
class, the same param groups and hyper-parameters, restricted to those parameters). A global
forward pre-hook makes each module wait only for the updates of its own parameters
(``module._parameters``), so the first layers compute while the last buckets still travel.
With ``shard_optimizer=True`` the per-bucket update is the sharded step's instead
(:meth:`ringtrain.engine.sharded.ShardedStep.step_bucket`: this rank's shard, then the bucket's
all-gather), so the gathers too run while the next forward computes.

Launch order (:func:`launch_order`). Backward makes the last layers' gradients ready first and
the next forward needs the first layers first. The bucket *contents* are the engine's plan (so
every sum is the same as without overlap); only the order in which buckets are launched changes,
and it is a pure function of data every rank holds alike after the learning step: rank 0's
ready times, the bucket sizes, each bucket's first parameter in registration order (the forward
order of most models) and the link rate all ranks agreed on. It replays one step with a link
that takes the ready bucket the next forward needs first (P3's and ByteScheduler's priority
rule): during backward that sends the last layers as they become ready, keeping the link busy,
and once backward ends the rest goes in forward order. No negotiation per step: every rank
launches the same fixed sequence, each bucket once it is complete.

The contract, tested in tests/engine/test_overlap.py and written in docs/engine.md: a
parameter is updated by the time the forward of a module that holds it starts, by the first
gradient of the next backward pass, and by ``synchronize()``, ``state_dict()`` (optimizer's,
and a module's that ran forward since), ``load_state_dict()``; ``zero_grad()`` is deferred per
bucket (applied right after the bucket's update). Reading a tensor directly (``p.clone()``)
between ``step()`` and the next forward needs ``synchronize()`` first. ``shutdown()`` and the
process's exit wait for the last step's update (:func:`finish_all`) and fail where it cannot end.
"""

from __future__ import annotations

import heapq
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ringtrain.diagnostics import timeline
from ringtrain.engine.buckets import NOT_SEEN, Observation, Plan
from ringtrain.errors import (
    CollectiveAbortedError,
    CollectiveError,
    ConfigError,
    RingtrainError,
    StallError,
)
from ringtrain.runtime import abort, departures, exit_guard

# Fixed cost of one collective (Gloo's setup and thread hand-offs), in the replay.
OP_COST_S = 0.001

# Optimizers whose update of a parameter reads only that parameter, its gradient and its own
# state: stepping them bucket by bucket is the same computation as one step over all.
PER_PARAMETER_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


def per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of :data:`PER_PARAMETER_OPTIMIZERS`, or a subclass that keeps
    its ``step`` (one that overrides it may compute anything across parameters)."""
    # Compared unwrapped: torch wraps a class's step for its profiler hooks at the class's first
    # instance, so a subclass made before its base's first instance holds its own wrapper.
    own = inspect.unwrap(type(optimizer).step)
    return any(
        isinstance(optimizer, cls) and own is inspect.unwrap(cls.step)
        for cls in PER_PARAMETER_OPTIMIZERS
    )


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """ConfigError unless ``optimizer`` updates every parameter on its own (see above)."""
    if not per_parameter(optimizer):
        names = ", ".join(c.__name__ for c in PER_PARAMETER_OPTIMIZERS)
        raise ConfigError(
            f"overlap=True steps the optimizer bucket by bucket, which needs an update per "
            f"parameter; {type(optimizer).__name__} is not one of the optimizers known to work "
            f"that way ({names}).\nHINT: pass overlap=False (the default) for this optimizer."
        )


def check_dense(plan: Plan, names: Sequence[str]) -> None:
    """ConfigError if ``plan`` has sparse gradients. Checked where the learning step agrees on
    the plan (alike on every rank, before any gradient is reduced or parameter updated), so
    the first step is refused, not the second."""
    if plan.sparse:
        raise ConfigError(
            "overlap=True needs dense gradients, but "
            f"{', '.join(names[i] for i in plan.sparse)} came sparse.\n"
            "HINT: pass sparse_as_dense=True, or overlap=False."
        )


@dataclass(frozen=True)
class BucketTiming:
    """What the replay knows about one bucket."""

    ready_s: float  # when its last gradient became ready, after the first one (rank 0)
    nbytes: int
    first_use: int  # its first parameter in registration order: lower is needed sooner


def timings(plan: Plan, observed: Observation) -> list[BucketTiming]:
    """Per bucket of ``plan``, from rank 0's learning step (``observed``)."""
    last = max(observed.ready_us, default=0)
    out = []
    for b in plan.buckets:
        ready = [
            observed.ready_us[i] if observed.position[i] != NOT_SEEN else last for i in b.params
        ]
        out.append(BucketTiming(max(ready) / 1e6, b.nbytes, min(b.params)))
    return out


def launch_order(buckets: Sequence[BucketTiming], bytes_per_s: float) -> list[int]:
    """The order to launch buckets in: replay a step where the link, whenever it is free, takes
    the ready bucket with the lowest ``first_use`` (or waits for the next one to become ready).
    Pure and deterministic (ties broken by bucket index), so every rank computes the same."""
    rate = bytes_per_s if bytes_per_s > 0 else float("inf")
    by_ready = sorted(range(len(buckets)), key=lambda i: (buckets[i].ready_s, i))
    ready: list[tuple[int, int]] = []  # (first_use, index)
    order: list[int] = []
    t, nxt = 0.0, 0
    while len(order) < len(buckets):
        while nxt < len(by_ready) and buckets[by_ready[nxt]].ready_s <= t:
            i = by_ready[nxt]
            heapq.heappush(ready, (buckets[i].first_use, i))
            nxt += 1
        if not ready:
            t = buckets[by_ready[nxt]].ready_s
            continue
        _, i = heapq.heappop(ready)
        order.append(i)
        t += OP_COST_S + buckets[i].nbytes / rate
    return order


def steps_alike_by_bucket(optimizer: torch.optim.Optimizer) -> bool:
    """Whether stepping ``optimizer`` bucket by bucket (:func:`step_subset`) is what one
    ``optimizer.step()`` would do, observably too: a per-parameter optimizer, with no step hooks
    (they would run once per bucket) and no ``step`` patched onto the instance (an LR scheduler
    given the wrapped optimizer counts its calls that way)."""
    from torch.optim import optimizer as torch_optimizer

    return (
        per_parameter(optimizer)
        and "step" not in vars(optimizer)
        and not getattr(optimizer, "_optimizer_step_pre_hooks", None)
        and not getattr(optimizer, "_optimizer_step_post_hooks", None)
        and not torch_optimizer._global_optimizer_pre_hooks
        and not torch_optimizer._global_optimizer_post_hooks
    )


def bucket_groups(
    optimizer: torch.optim.Optimizer, members: Sequence[Sequence[torch.Tensor]]
) -> list[list[dict[str, Any]]]:
    """Per bucket, ``optimizer``'s param groups restricted to the bucket's parameters (``members``),
    with the hyper-parameters as they are now: what :func:`step_subset` takes."""
    index = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    groups = [dict(group) for group in optimizer.param_groups]
    plans: list[list[dict[str, Any]]] = []
    for params in members:
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_group.setdefault(index[id(p)], []).append(p)
        plans.append([{**groups[g], "params": ps} for g, ps in sorted(by_group.items())])
    return plans


def step_subset(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Run ``optimizer``'s own ``step`` over ``groups`` (its param groups restricted to some
    parameters) on a shallow twin that shares its state. The class's ``step`` is called, not
    the instance's attribute, which an LR scheduler may have wrapped to count steps."""
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    twin.__dict__.pop("step", None)
    twin.param_groups = groups
    type(optimizer).step(twin)


def zero_param_grad(p: torch.Tensor, set_to_none: bool) -> None:
    """What ``Optimizer.zero_grad`` does to one parameter."""
    if p.grad is None:
        return
    if set_to_none:
        p.grad = None
    else:
        if p.grad.grad_fn is not None:
            p.grad.detach_()
        else:
            p.grad.requires_grad_(False)
        p.grad.zero_()


class _Pending:
    """One bucket's update in flight: the forward of its parameters waits on it. It holds its
    Overlap weakly: no reference cycle, so a dropped optimizer is freed at once, never by the
    garbage collector at some later point."""

    __slots__ = ("_owner", "done")

    def __init__(self, owner: Overlap) -> None:
        self.done = threading.Event()
        self._owner = weakref.ref(owner)

    @property
    def owner(self) -> Overlap:
        owner = self._owner()
        if owner is None:  # its optimizer is gone: nothing can be pending any more
            raise CollectiveError("an overlapped optimizer was dropped with updates pending")
        return owner


# id(parameter) -> its bucket's pending update, for every overlapped optimizer of the process.
_waits: dict[int, _Pending] = {}
_waits_lock = threading.Lock()
_hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_global_hook: Any = None
# Modules whose forward ran, and per such module the parameters of its descendants whose own
# forward never runs (MultiheadAttention reads out_proj.weight without calling out_proj): the
# module that does run waits for those too.
_called: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_extra: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.Tensor]] = weakref.WeakKeyDictionary()
_generation = [0]  # bumped whenever a module runs its forward for the first time
_extra_of = [-1]  # the generation _extra was computed at


def _forward_pre_hook(module: torch.nn.Module, _args: Any) -> None:
    """Every module's forward: wait for the updates of the module's own parameters (and of
    descendants that never run their own forward)."""
    if module not in _called:
        _called.add(module)
        _generation[0] += 1
    if not _waits:
        return
    for p in _own(module):
        pending = _waits.get(id(p))
        if pending is None:
            continue
        pending.owner.note_forward()
        if not pending.done.is_set():
            pending.owner.wait_for(pending)
        pending.owner.raise_error()


def _own(module: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters a module's forward waits for: its own, and those of descendants that
    never run their own forward."""
    params = [p for p in module._parameters.values() if p is not None]
    extra = _extra.get(module)
    return [*params, *extra] if extra else list(params)


def _drain_for_state_dict(module: torch.nn.Module, _prefix: str, _keep_vars: bool) -> None:
    """model.state_dict() drains first: the module's parameters are then final."""
    for p in _own(module):
        pending = _waits.get(id(p))
        if pending is not None:
            pending.owner.drain()


def _hook_state_dicts(ids: set[int]) -> None:
    """Every module that ran forward and holds one of these parameters drains in state_dict()."""
    for m in list(_called):
        if m not in _hooked and any(id(p) in ids for p in _own(m)):
            m.register_state_dict_pre_hook(_drain_for_state_dict)
            _hooked.add(m)


def _cover_uncalled() -> None:
    """Recompute ``_extra`` when modules ran their forward for the first time."""
    if _extra_of[0] == _generation[0]:
        return
    called = list(_called)
    _extra.clear()
    for m in called:
        found: list[torch.Tensor] = []
        todo = list(m.children())
        while todo:
            child = todo.pop()
            if child in _called:
                continue  # it waits for its own
            found.extend(p for p in child._parameters.values() if p is not None)
            todo.extend(child.children())
        if found:
            _extra[m] = found
    _extra_of[0] = _generation[0]


def _install_global_hook() -> None:
    global _global_hook
    if _global_hook is None:
        _global_hook = torch.nn.modules.module.register_module_forward_pre_hook(_forward_pre_hook)


class Overlap:
    """The pending updates of one DistributedOptimizer (one step's at a time)."""

    def __init__(self, optimizer: torch.optim.Optimizer, timeout_s: float) -> None:
        check_optimizer(optimizer)
        self._optimizer = optimizer
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._pending: list[_Pending] = []
        self._members: list[list[torch.Tensor]] = []
        self._zero: list[bool | None] = []  # deferred zero_grad per bucket (set_to_none)
        self._forward_t0 = 0.0
        self._generation = -1  # of the modules seen when state_dict hooks were last placed
        _install_global_hook()
        _live.add(self)

    @property
    def pending(self) -> bool:
        return not self._idle.is_set()

    # ---- step() -------------------------------------------------------------------------------

    def start(
        self,
        order: Sequence[int],
        members: Sequence[Sequence[torch.Tensor]],
        finish_slot: Callable[[int], None],
        finish_all: Callable[[], None],
        update: Callable[[int], None] | None = None,
        watch: tuple[Any, int] | None = None,
    ) -> None:
        """Update bucket ``order[0]``, ``order[1]``, ... as each one's reduction completes
        (``finish_slot(s)`` waits for bucket ``s`` and writes its averages into ``.grad``),
        then ``finish_all()``. The buckets are launched already; this returns at once.
        ``update(s)``, if given, updates bucket ``s`` instead of the wrapped optimizer (the
        sharded step: this rank's shard, then the all-gather of the bucket's parameters).
        ``watch``: the optimizer's :class:`~ringtrain.diagnostics.engine_wait.WaitWatch` and
        this step's number: the updater's wait is watched as ``step()``'s own."""
        assert not self.pending, "start() while the previous step's updates are pending"
        opt = self._optimizer
        # The hyper-parameters as they are now: an LR scheduler may change them after step().
        plans = bucket_groups(opt, members)
        self._members = [list(m) for m in members]
        self._pending = [_Pending(self) for _ in members]
        self._zero = [None] * len(members)
        self._error = None
        self._forward_t0 = 0.0
        if self._generation != _generation[0]:
            self._generation = _generation[0]
            _cover_uncalled()
            _hook_state_dicts({id(p) for params in members for p in params})
        with _waits_lock:
            for pending, params in zip(self._pending, members):
                for p in params:
                    _waits[id(p)] = pending
        self._idle.clear()
        run = update if update is not None else (lambda s: step_subset(opt, plans[s]))
        jobs = (list(order), run, finish_slot, finish_all)
        self._submit(lambda: self._watched(watch, jobs))

    def _watched(self, watch: tuple[Any, int] | None, jobs: tuple[Any, Any, Any, Any]) -> None:
        """:meth:`_run`, its wait watched as a synchronous ``step()``'s (engine_wait): past the
        stall warning time it names the ranks missing; past the stall shutdown time it ends in
        a StallError naming them, which the main thread raises at its next wait (the next
        forward, ``synchronize()``, ``shutdown()`` or the exit)."""
        if watch is None:
            self._run(*jobs)
            return
        w, step = watch
        w.begin(step)
        try:
            with abort.stopping(w.check if w.shutdown_s > 0 else None):
                self._run(*jobs, named=w.failed)
        finally:
            w.end()

    def _run(
        self,
        order: list[int],
        update: Callable[[int], None],
        finish_slot: Callable[[int], None],
        finish_all: Callable[[], None],
        named: Callable[[BaseException], BaseException] | None = None,
    ) -> None:
        """``named(e)``: the error to hand on for a wait that failed in ``e`` (the watch's:
        past the transport timeout, a StallError naming the ranks elsewhere)."""
        rec = timeline.current()
        try:
            for s in order:
                finish_slot(s)
                t0 = time.perf_counter()
                update(s)
                with self._lock:
                    zero = self._zero[s]
                    if zero is not None:
                        for p in self._members[s]:
                            zero_param_grad(p, zero)
                    self._pending[s].done.set()
                if rec.enabled:
                    rec.span("update", "OPTIMIZER_STEP", t0, time.perf_counter(), {"bucket": s})
            finish_all()
        except BaseException as e:  # handed to the main thread at its next wait
            self._error = e
            if named is not None and not isinstance(e, RingtrainError):
                self._error = named(e)
        finally:
            with self._lock:
                for pending in self._pending:
                    pending.done.set()
            with _waits_lock:
                for params, pending in zip(self._members, self._pending):
                    for p in params:
                        if _waits.get(id(p)) is pending:
                            del _waits[id(p)]
            self._idle.set()

    def _cancel(self) -> None:
        """The process is exiting before this step's update ran: nothing waits in vain."""
        self._error = CollectiveAbortedError("the process is exiting; the update did not run")
        with self._lock:
            for pending in self._pending:
                pending.done.set()
        self._idle.set()

    # ---- waiting --------------------------------------------------------------------------------

    def note_forward(self) -> None:
        if self._forward_t0 == 0.0 and timeline.current().enabled:
            self._forward_t0 = time.perf_counter()

    def wait_for(self, pending: _Pending) -> None:
        t0 = time.perf_counter()
        if not pending.done.wait(self._timeout_s + 30.0):
            raise CollectiveError(
                f"a parameter's update did not finish within {self._timeout_s:.0f} s "
                "(overlap=True): some rank stopped exchanging gradients.\n"
                "HINT: every rank must call step() as often as the others."
            )
        rec = timeline.current()
        if rec.enabled:
            rec.span("compute", "WAIT_UPDATE", t0, time.perf_counter())

    def raise_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    def drain(self) -> None:
        """Wait until every pending update is done (re-raising the updater's error)."""
        if self._idle.is_set():
            self.raise_error()
            return
        if not self._idle.wait(self._timeout_s + 30.0):
            raise CollectiveError(
                f"the optimizer's pending updates did not finish within {self._timeout_s:.0f} s "
                "(overlap=True): some rank stopped exchanging gradients."
            )
        self.raise_error()

    def forward_ended(self) -> None:
        """The first gradient of the next backward: the FORWARD span ends (timeline only)."""
        if self._forward_t0:
            rec = timeline.current()
            rec.span("compute", "FORWARD", self._forward_t0, time.perf_counter())
            self._forward_t0 = 0.0

    def zero_grad(self, params: Sequence[torch.Tensor], set_to_none: bool) -> None:
        """Zero now what is final; a pending bucket's gradients right after its update."""
        with self._lock:
            later: set[int] = set()
            for s, pending in enumerate(self._pending):
                if not pending.done.is_set():
                    self._zero[s] = set_to_none
                    later.update(id(p) for p in self._members[s])
            for p in params:
                if id(p) not in later:
                    zero_param_grad(p, set_to_none)

    # ---- the updater thread ----------------------------------------------------------------------

    def _submit(self, job: Callable[[], None]) -> None:
        global _updater
        with _wake:
            _jobs.append((job, self._cancel))
            _wake.notify()
            if _updater is None:
                _updater = threading.Thread(target=_serve, name="ringtrain-overlap", daemon=True)
                _updater.start()

    def close(self) -> None:
        """Let pending updates end (a dropped optimizer's step still completes on every rank)."""
        if self.pending:
            self._idle.wait(self._timeout_s + 30.0)


# Every overlapped optimizer of the process: shutdown and exit finish their pending updates.
_live: weakref.WeakSet[Overlap] = weakref.WeakSet()


def drain_all() -> None:
    """Wait for every overlapped optimizer's pending updates (each bounded by the transport
    timeout), re-raising the first error of an updater once all are drained."""
    failed: BaseException | None = None
    for overlap in list(_live):
        try:
            overlap.drain()
        except Exception as e:
            failed = failed or e
    if failed is not None:
        raise failed


def finish_all(before: str) -> None:
    """:func:`drain_all`, ``before`` shutting down or exiting: ``step()`` returned before its
    update, which a script that ends there never waits for. Raises if one did not complete (or
    failed earlier, unseen): the parameters miss that update, and the rank must not end as if
    they did not."""
    try:
        drain_all()
    except StallError as failed:  # the watched wait ended: its report whole, not summarized
        raise StallError(
            f"the last step's update did not complete before {before} (overlap=True); this "
            f"rank's parameters miss it: {failed}"
        ) from failed
    except Exception as failed:
        kind = (
            CollectiveAbortedError
            if isinstance(failed, CollectiveAbortedError)
            else CollectiveError
        )
        raise kind(
            f"the last step's update did not complete before {before} (overlap=True: step() "
            "returns before the update, which ends once every rank's gradients arrived); this "
            f"rank's parameters miss it: {departures.summary(failed)}\n"
            "HINT: every rank must call step() as often as the others, each within the "
            "transport timeout (--timeout, RINGTRAIN_TIMEOUT_S) of the others."
        ) from failed


# One updater thread per process, for every overlapped optimizer, started at the first step and
# kept for the life of the process: a thread that ended while the collector freed tensors could
# take the GIL inside a C++ destructor. Idle, it holds no job and no tensor.
_jobs: list[tuple[Callable[[], None], Callable[[], None]]] = []  # (update, cancel)
_wake = threading.Condition()
_updater: threading.Thread | None = None


def _serve() -> None:
    torch.set_grad_enabled(False)  # grad mode is per thread
    while True:
        with _wake:
            while not _jobs:
                _wake.wait()
            job = _jobs.pop(0)
        # An update's torch calls release the GIL: the process's exit waits for the one under
        # way and starts no other (runtime.exit_guard).
        # Freeing the update's tensors is such a call too: the thread holds none while idle.
        with exit_guard.native_call() as ok:
            if ok:
                job[0]()
            else:
                with _wake:
                    left = [job, *_jobs]
                    _jobs.clear()
                exit_guard.keep(left)
                for _, cancel in left:
                    cancel()
                del left
            del job
        if not ok:
            return
