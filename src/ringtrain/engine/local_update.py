"""The local-update step (DiLoCo, arXiv 2311.08105): ``DistributedOptimizer(sync_every=H)``.

Each rank takes ``H`` steps with the wrapped (inner) optimizer on its own gradients, exchanging
nothing. Every ``H``-th ``step()`` is an *outer* step, in the same round on every rank (``H``
may differ per rank, ``sync_every=[48, 16]``: a faster rank takes more inner steps a round):

1. every rank's change since the last outer step, ``anchor - weights``, is averaged over the
   ranks through the transport, compressed (:mod:`ringtrain.engine.outer_codec`); under
   ``batch_shares`` or per-rank ``H`` each rank's change weighs by its samples (:attr:`weight`);
2. the weights are set back to the anchor and the outer optimizer steps with that average as
   its gradient (Nesterov SGD, lr 0.7, momentum 0.9, as the paper, unless the user gives a
   factory ``outer_optimizer(params) -> torch.optim.Optimizer``);
3. the result is the new anchor, the same on every rank.

So the link carries one (compressed) copy of the weights per ``H`` steps instead of the
gradients every step. With ``outer_fragments=P`` the parameters are cut into ``P`` fragments,
each averaged (steps 1-3 on its parameters) at its own step of the round
(:mod:`ringtrain.engine.outer_fragment`): the same bytes a round, ``1/P`` of them at a time.
The inner optimizer's state stays per rank, as in the paper. Buffers (BatchNorm statistics) are
not exchanged.

Every rank ends an outer step with the same weights, whatever it did before, provided the
anchors and the outer optimizer's state are the same on every rank: the first outer step after
construction, a loaded checkpoint or an elastic re-forming (:meth:`LocalUpdate.rejoin`) first
agrees them (:mod:`ringtrain.engine.anchor_agreement`: a digest, and rank 0's copy only where
the ranks' differ).

:class:`LocalUpdate` is a step strategy (:class:`ringtrain.engine.steps.Update`) whose
``exchanges()`` is always False: the gradient path then reduces nothing and calls its ``step()``.
:meth:`~LocalUpdate.rejoin` keeps the anchor and the outer state across an elastic re-forming.
With ``sync_every="auto"`` its first round decides (:mod:`ringtrain.engine.local_first`): the
rounds after it take the chosen ``H`` (:meth:`~LocalUpdate._resize`), or the round ends in a
plain average of the weights and the inner state and the optimizer goes synchronous.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from ringtrain import transport
from ringtrain.diagnostics import engine_wait, timeline
from ringtrain.engine import (
    anchor_agreement,
    local_first,
    local_policy,
    local_update_state,
    outer_fragment,
)
from ringtrain.engine.buckets import Plan
from ringtrain.engine.local_defaults import FirstRound
from ringtrain.engine.local_policy import OuterSettings
from ringtrain.engine.local_settings import bad_sync_every, outer_delay
from ringtrain.engine.outer_codec import OuterCodec
from ringtrain.engine.outer_fragment import Fragment
from ringtrain.engine.steps.whole import BucketUpdates, tensor_bytes
from ringtrain.engine.watched_wait import WatchedHold
from ringtrain.errors import ConfigError

# Key under which DistributedOptimizer.state_dict() keeps this step's state.
STATE_KEY = "ringtrain_local_update"
# arXiv 2311.08105, section 3: Nesterov momentum outer optimizer.
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9

T = TypeVar("T")
OuterFactory = Callable[[Sequence[torch.nn.Parameter]], torch.optim.Optimizer]


def nesterov(params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9."""
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


class LocalUpdate:
    """The local-update step of one DistributedOptimizer (see the module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
        group: Any,
        sync_every: int,
        outer_optimizer: OuterFactory | None,
        outer_compression: str,
        overlap: bool = False,
        delay: int = 0,
        fragments: int = 1,
        defaults: FirstRound | None = None,
    ) -> None:
        """``defaults``: a bare ``sync_every``'s first-round measurement, which may change the
        outer codec, overlap and delay at the first exchange (:mod:`ringtrain.engine.local_defaults`).
        """
        if sync_every < 1:
            raise bad_sync_every(sync_every)
        self.optimizer = optimizer
        self.sync_every = sync_every
        # Floating parameters only: an integer weight has no change to average.
        self._params = [p for p in params if p.is_floating_point()]
        self._compression = outer_compression
        self._factory = outer_optimizer or nesterov
        self.outer = self._factory(self._params)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ConfigError(
                f"outer_optimizer must return a torch.optim.Optimizer, got "
                f"{type(self.outer).__name__}.\nHINT: outer_optimizer=lambda params: "
                "torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)"
            )
        self._wire = transport.of(group)
        self._group = group  # the link probe's (local_defaults)
        # Each fragment: its parameters, its step of the round, error feedback, exchange in flight.
        self.fragments = outer_fragment.split(  # auto's H may be shorter than asked for
            self._params, min(fragments, sync_every), sync_every, outer_compression, self._wire
        )
        # Overlapped outer exchange (streaming DiLoCo's): see _start_exchange and _merge.
        self.overlap = overlap
        self.delay = outer_delay(delay, sync_every)
        # Every collective of the outer step runs as one job on the group's worker, queued from
        # the main thread: behind what other optimizers queued there before, in the same order
        # on every rank (transport.workers.SharedWorkers). An overlapped one is not waited for.
        self._serial = WatchedHold(group)
        self.anchor: list[torch.Tensor] | None = None
        self.inner_steps = 0  # since the round began
        self.outer_steps = 0  # rounds ended
        self._agree = True  # copy rank 0's anchor and outer state at the next outer step
        self.copies = 0  # how often that copy was needed (the ranks' digests differed)
        self.outer_seconds = 0.0  # wall time spent in outer steps (exchange included)
        # batch_shares or per-rank sync_every: this rank's samples a round over every rank's,
        # w_r (the optimizer sets it before each step); None: the plain mean of the changes.
        self.weight: float | None = None
        self._defaults = defaults

    # ---- the step strategy's interface (ringtrain.engine.steps.Update) -------------------------

    def exchanges(self) -> bool:
        return False  # gradients stay local; the weights travel at outer steps

    def bucket_updates(self, exchange: Any, timer: Any) -> BucketUpdates | None:
        return None

    def bucket_update(self, group: Any) -> Callable[[int], None] | None:
        return None

    def replan(self, plan: Plan | None) -> None:
        pass

    def held(self) -> Any:
        return None  # the wrapped optimizer holds its state whole

    @property
    def state_bytes(self) -> int:
        return tensor_bytes(self.optimizer.state) + tensor_bytes(self.outer.state)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict with this step's under :data:`STATE_KEY`."""
        sd = self.optimizer.state_dict()
        sd[STATE_KEY] = self.local_state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        local = sd.pop(STATE_KEY, None)
        self.optimizer.load_state_dict(sd)
        if local is not None:
            self.load_local_state_dict(local)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank sent for outer steps (the anchor copies after a re-form excluded)."""
        return sum(f.codec.bytes_sent for f in self.fragments)

    @property
    def codec_name(self) -> str:
        return self._compression

    @property
    def takes_saved_codec(self) -> bool:
        """Whether a load takes the saved codec: a bare ``sync_every``'s or ``auto``'s
        defaults chose it, the user gave no ``outer_compression`` (see :meth:`_adopt`)."""
        first = self._defaults
        return first is not None and not first.config.given("outer_compression")

    # ---- the optimizer's calls ------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One inner step; then each fragment's average that is due is applied, and the fragment
        whose step of the round this is is exchanged (at the round's end: the whole model, or
        the last fragment)."""
        if self.anchor is None:
            self.anchor = [p.detach().clone() for p in self._params]
        first = self._defaults
        if first is not None:
            # Beside the steps; the group's collectives issued meanwhile wait for it.
            first.start_probe(self._serial.submit_beside, self._group, self._params)
            first.tick()
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.inner_steps += 1
        for frag in self.fragments:
            if frag.pending is not None:
                frag.since_sent += 1
                if frag.since_sent >= self.delay:
                    self._timed("OUTER_MERGE", frag, self._merge)
        for frag in self.fragments:
            if frag.end == self.inner_steps:
                self._timed("OUTER_STEP", frag, self._exchange)
        if self.inner_steps >= self.sync_every:
            self._end_round()
        return result

    def outer_step(self) -> None:
        """Every fragment's outer step now (collective), and a new round; overlapped: their
        averages are applied ``delay`` inner steps later."""
        for frag in self.fragments:
            self._timed("OUTER_STEP", frag, self._exchange)
        self._end_round()

    def _end_round(self) -> None:
        self.inner_steps = 0
        self.outer_steps += 1
        first = self._defaults
        if first is None or first.next_every is None:
            return
        if first.next_every == 0:
            self._average_all()
            first.left = True
        else:
            self._resize(first.next_every)
        first.next_every = None

    @property
    def left(self) -> bool:
        """``sync_every="auto"``: the round that chose synchronous training has ended."""
        return self._defaults is not None and self._defaults.left

    def _resize(self, every: int) -> None:
        """Rounds of ``every`` inner steps from now on (auto's choice after its first round);
        each fragment keeps its place in the round."""
        self.sync_every = every
        for frag in self.fragments:
            frag.end = every * (frag.index + 1) // len(self.fragments)

    def _average_all(self) -> None:
        """Leaving for synchronous training: every rank takes the plain mean of the ranks'
        weights and of the inner optimizer's floating state (Adam's moments; ``step`` is
        equal on every rank), so synchronous steps start from one model and one state."""
        with torch.no_grad():
            state = self.optimizer.state
            held = [  # per-element state, shaped like its parameter (as torch loads it)
                v
                for p in self._params
                for k, v in sorted(state.get(p, {}).items())
                if k != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape
            ]
            tensors = [p.detach() for p in self._params] + held
            flat = torch.cat([t.float().reshape(-1) for t in tensors]).cpu()
            mean = self.after_exchanges(lambda: OuterCodec("none", self._wire).average(flat))
            for t, m in zip(tensors, torch.split(mean, [t.numel() for t in tensors])):
                t.copy_(m.view_as(t))

    def _timed(self, name: str, frag: Fragment, part: Callable[[Fragment], None]) -> None:
        t0 = time.perf_counter()
        part(frag)
        t1 = time.perf_counter()
        self.outer_seconds += t1 - t0
        args = {"fragment": frag.index} if len(self.fragments) > 1 else None
        timeline.current().span("step", name, t0, t1, args)

    def _exchange(self, frag: Fragment) -> None:
        first = self._defaults
        if first is not None and not first.settled:
            numel = sum(p.numel() for p in self._params)
            rank, size = self._wire.rank, self._wire.size
            outer = self.after_exchanges(
                lambda: first.settle(self._group, numel, self.sync_every, rank, size)
            )
            if first.choice is not None:
                first.next_every = first.choice.sync_every
            if outer is not None:
                self.use(outer, first.next_every)
        if self._defaults is not None and self._defaults.next_every == 0:
            return  # leaving: the round's end averages the whole model (_average_all)
        if self.overlap and self._wire.size > 1:
            self._start_exchange(frag)
        else:
            self._synchronous_step(frag)

    def use(self, outer: OuterSettings, every: int | None = None) -> None:
        """Run the outer exchange as ``outer`` says from the next exchange on (nothing in
        flight: before the first), its delay within rounds of ``every`` inner steps (None:
        ``sync_every``). Error feedback carries over: it is what rounding dropped."""
        if outer.compression != self._compression:
            self._compression = outer.compression
            for frag in self.fragments:
                residual = frag.codec.residual
                frag.codec = OuterCodec(outer.compression, self._wire)
                frag.codec.residual = residual
        self.overlap = outer.overlap
        self.delay = outer_delay(outer.delay, every or self.sync_every)
        if self._defaults is not None:
            self._defaults.why = outer.why

    def after_exchanges(self, fn: Callable[[], T]) -> T:
        """``fn()`` (collectives on the outer exchange's group) once what was queued there
        before has ended, this optimizer's exchanges in flight and any other's: on the group's
        worker, so every rank runs it in the same order with them. It waits for them (an
        overlapped round's exchange is then exposed)."""
        return self._serial.result(self._serial.submit(fn), self.sync_every)

    def watch(self, watch: engine_wait.WaitWatch | None) -> None:
        """The optimizer's wait watch (None: none; set before each step, the watch is made
        again when the world is re-formed): the waits for the outer exchange name the ranks
        missing past the stall warning time, and end at the stall shutdown time."""
        self._serial.watch = watch

    @property
    def outer_reason(self) -> str:
        """A bare ``sync_every``'s outer exchange: what was chosen and why ("": the Config's
        settings, as given or not yet measured)."""
        return self._defaults.why if self._defaults is not None else ""

    def _agree_first(self) -> None:
        """The first outer step after a start, a load or a re-forming: every rank takes rank 0's
        anchor and outer state where they differ. The wire is free: every path that sets
        ``_agree`` (a load, a re-forming, a restart) first lets the exchanges in flight end."""
        if self._agree and self._wire.size > 1:
            anchor = self.anchor
            assert anchor is not None
            got = self.after_exchanges(
                lambda: anchor_agreement.from_root(self._wire, anchor, self.outer)
            )
            if got is not None:  # the digests differed: rank 0's copy
                self.copies += 1
                self.anchor = [a.to(p.device) for a, p in zip(got, self._params)]
        self._agree = False

    def _synchronous_step(self, frag: Fragment) -> None:
        """The fragment's change averaged now, and its anchor stepped with it."""
        with torch.no_grad():
            if self.anchor is None:
                self.anchor = [p.detach().clone() for p in self._params]
            self._agree_first()
            change = self._change(frag)
            self._step_anchor(frag, self.after_exchanges(lambda: frag.codec.average(change)))

    def _start_exchange(self, frag: Fragment) -> None:
        """The overlapped outer step's first half: the fragment's change, ``anchor - weights``,
        starts travelling in the background and the inner steps go on from these weights;
        :meth:`_merge` applies its average ``delay`` inner steps later. One thread carries every
        exchange, in the order they were started: the same order on every rank."""
        with torch.no_grad():
            if frag.pending is not None:  # outer_step() called before the average was due
                self._merge(frag)
            if self.anchor is None:
                self.anchor = [p.detach().clone() for p in self._params]
            self._agree_first()
            change = self._change(frag)
            frag.base = [self._params[i].detach().clone() for i in frag.indices]
            frag.pending = self._serial.submit(frag.codec.average, change)
            frag.since_sent = 0

    def _merge(self, frag: Fragment) -> None:
        """The overlapped outer step's second half, ``delay`` inner steps after the first, at
        the same step on every rank: the average, waited for in full, steps the fragment's
        anchor, and each rank continues from it plus its own progress since it sent (which
        belongs to the next round's change). What is applied never depends on when the
        exchange finished."""
        assert frag.pending is not None and frag.base is not None
        mean = self._serial.result(frag.pending, self.sync_every)
        frag.pending = None
        with torch.no_grad():
            progress = [self._params[i].detach() - b for i, b in zip(frag.indices, frag.base)]
            frag.base = None
            self._step_anchor(frag, mean)
            for i, d in zip(frag.indices, progress):
                self._params[i].add_(d)

    def _change(self, frag: Fragment) -> torch.Tensor:
        """``anchor - weights`` of the fragment's parameters, flat, float32, in host memory: the
        outer exchange goes over the engine's Gloo group, and its codec, its error feedback
        and the background exchange then never touch a GPU stream. Under ``batch_shares``
        it is scaled by ``w_r * size``, so that the codec's mean is the mean weighted by the
        ranks' shares (as :meth:`ringtrain.engine.weighting.Averaging.codec_factors` scales a
        gradient); equal shares (``weight`` None) keep the plain mean's bits."""
        assert self.anchor is not None
        change = torch.cat(
            [
                (self.anchor[i].float() - self._params[i].detach().float()).reshape(-1)
                for i in frag.indices
            ]
        ).cpu()
        if self.weight is not None and self._wire.size > 1:
            change.mul_(self.weight * self._wire.size)
        return change

    def _step_anchor(self, frag: Fragment, mean: torch.Tensor) -> None:
        """The outer optimizer steps the fragment's anchor with ``mean`` as its gradient (leaves
        its parameters holding the new anchor). The other parameters have no gradient for this
        step: the outer optimizer leaves them and their state as they are."""
        assert self.anchor is not None
        saved = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        offset = 0
        for i in frag.indices:
            p = self._params[i]
            n = p.numel()
            p.copy_(self.anchor[i])
            p.grad = mean[offset : offset + n].view_as(p).to(p.device, p.dtype)
            offset += n
        with torch.enable_grad():
            self.outer.step()
        for p, g in zip(self._params, saved):
            p.grad = g
        for i in frag.indices:
            self.anchor[i] = self._params[i].detach().clone()

    @contextlib.contextmanager
    def anchored(self) -> Iterator[None]:
        """The parameters hold the anchor (the weights every rank agrees on) inside the block,
        their own values again after it: to evaluate an overlapped run's model."""
        if self.anchor is None:
            yield
            return
        with torch.no_grad():
            own = [p.detach().clone() for p in self._params]
            for a, p in zip(self.anchor, self._params):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for o, p in zip(own, self._params):
                    p.copy_(o)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The parameters it averages (the floating ones, in the optimizer's order); the
        anchor's tensors and a checkpoint's per-rank weights follow this order."""
        return self._params

    @property
    def agreed(self) -> bool:
        """Whether every rank holds the same anchor and outer state (after an outer step); False
        before the first outer step, after a load or an elastic re-forming, until the next."""
        return not self._agree

    def local_state_dict(self, copy: bool = True) -> dict[str, Any]:
        """This step's state; ``copy=False``: views (a checkpoint copies them to host memory
        itself; copy them before the next step). ``agreed``: see :attr:`agreed`. Per fragment:
        ``codec.residual``, ``overlap.pending`` and ``overlap.since_sent`` are lists, one entry a
        fragment; ``overlap.base`` is per parameter (None where its fragment has nothing in
        flight). The format: :mod:`ringtrain.engine.local_update_state`; a bare ``sync_every``
        whose outer exchange the defaults chose adds ``outer_choice`` (codec, overlap, delay),
        which a load takes instead of measuring again. (``sync_every="auto"``'s H is kept with
        the compression's state: :meth:`ringtrain.engine.gradient_path.GradientPath.restored`.)
        """
        state = local_update_state.save(self, copy)
        if self._defaults is not None and self._defaults.settled:
            state["outer_choice"] = {
                "compression": self._compression,
                "overlap": self.overlap,
                "delay": self.delay,
                "why": self.outer_reason,
            }
        return state

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """A state of :meth:`local_state_dict`; one written before fragments (versions 1 and
        2: the whole model in one exchange) loads into any number of fragments. Where the
        codec was the defaults' to choose (a bare ``sync_every``), the saved one is used."""
        self._adopt(state)
        version = local_update_state.check(self, state)
        # An exchange still in flight from before the load would overwrite the loaded error
        # feedback as it ends, and share the wire with the next: let it end, then drop it.
        self._drop_pending()
        local_update_state.restore(self, state, version)
        self._agree = True

    def _adopt(self, state: dict[str, Any]) -> None:
        """A bare ``sync_every``'s defaults: the saved choice (no measurement after a load, so
        a resumed job runs as the uninterrupted one), else the saved codec where not given."""
        first = self._defaults
        if first is None:
            return
        choice = state.get("outer_choice")
        if first.decides:  # sync_every="auto": the round in progress when saved
            self._resize(int(state.get("sync_every", self.sync_every)))
        if isinstance(choice, dict):
            first.settled = True
            self.use(OuterSettings(**choice))
            return
        saved = (state.get("codec") or {}).get("name")
        if not self.takes_saved_codec or saved == self._compression:
            return
        if isinstance(saved, str) and saved in local_policy.CODEC_BYTES:
            why = f"{saved}, as the checkpoint's exchange"
            self.use(OuterSettings(saved, self.overlap, self.delay, why))

    def resume(self, choice: local_first.Choice) -> None:
        """``sync_every="auto"``'s saved choice of local updates: rounds of its H from the end
        of the round in progress (the link is measured again for the outer exchange only)."""
        assert self._defaults is not None and choice.sync_every > 0
        self._defaults.choice = choice
        every = choice.sync_every
        self._defaults.next_every = every if every != self.sync_every else None

    @property
    def auto_choice(self) -> local_first.Choice | None:
        """``sync_every="auto"``'s choice once made (None: not deciding, or not yet)."""
        return self._defaults.choice if self._defaults is not None else None

    def restart(self) -> None:
        """Start afresh from the current weights (a checkpoint without local-update state was
        loaded): the next step takes them as the anchor; fresh outer optimizer and error
        feedback; the next outer step agrees on the anchor."""
        self._drop_pending()
        self.anchor = None
        self.inner_steps = 0
        self.outer = self._factory(self._params)
        for frag in self.fragments:
            frag.codec.residual = None
        self._agree = True

    def rejoin(self, group: Any) -> None:
        """Elastic: the world was re-formed. Every rank starts a new round of ``sync_every``
        inner steps; the next outer step copies rank 0's anchor and outer state first, so all
        ranks, joined ones too, hold the same weights after it. Error feedback starts afresh."""
        self._drop_pending()
        if self._defaults is not None:
            self._defaults.probe = None  # the old world's: probed again on the new one
        self._wire.close()
        self._serial.release()
        self._wire = transport.of(group)
        self._group = group
        self._serial = WatchedHold(group)
        for frag in self.fragments:
            frag.codec = OuterCodec(self._compression, self._wire)
        self.inner_steps = 0
        self._agree = True

    def close(self) -> None:
        self._drop_pending(settle=False)  # the wire closes: nothing uses it after
        self._wire.close()
        self._serial.release()

    def _drop_pending(self, settle: bool = True) -> None:
        """Elastic, a restart or closing: the exchanges in flight are given up on every rank
        alike (not applied on some ranks only); their change is still in each rank's weights,
        and travels with the next outer step's. ``settle``: they may still be using the wire,
        which stays in use, so they are let end first (on a whole world they complete; where a
        rank is gone, the wire fails them at once, and those of a world the launcher replaced
        are not waited for: Fragment.drop); closing does not wait, the wire closes under them."""
        for frag in self.fragments:
            frag.drop(settle)
