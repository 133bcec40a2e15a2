"""The local-update step (DiLoCo, arXiv 2311.08105): ``DistributedOptimizer(sync_every=H)``.

Each rank takes ``H`` steps with the wrapped (inner) optimizer on its own gradients, exchanging
nothing. Every ``H``-th ``step()`` is an *outer* step, at the same step on every rank:

1. every rank's change since the last outer step, ``anchor - weights``, is averaged over the
   ranks through the transport, compressed (:mod:`ringtrain.engine.outer_codec`);
2. the weights are set back to the anchor and the outer optimizer steps with that average as
   its gradient (Nesterov SGD, lr 0.7, momentum 0.9, as the paper, unless the user gives a
   factory ``outer_optimizer(params) -> torch.optim.Optimizer``);
3. the result is the new anchor, the same on every rank.

So the link carries one (compressed) copy of the weights per ``H`` steps instead of the
gradients every step. The inner optimizer's state stays per rank, as in the paper. Buffers
(BatchNorm statistics) are not exchanged.

Every rank ends an outer step with the same weights, whatever it did before, provided the
anchors and the outer optimizer's state are the same on every rank: the first outer step after
construction, a loaded checkpoint or an elastic re-forming (:meth:`LocalUpdate.rejoin`) first
compares a digest of every rank's anchor and outer state (32 bytes a rank) and, only where they
differ, copies rank 0's to every rank. Ranks that start alike (the usual case: the same seed or
a broadcast) so send no copy of the weights: on a slow link that copy cost as much as several
outer steps. Nothing here depends on timing: the digest is of the bits.

:class:`LocalUpdate` is a step strategy (:class:`ringtrain.engine.steps.Update`) whose
``exchanges()`` is always False: the gradient path then reduces nothing and calls its ``step()``.
:meth:`~LocalUpdate.rejoin` keeps the anchor and the outer state across an elastic re-forming.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import io
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ringtrain import transport
from ringtrain.config import Config
from ringtrain.diagnostics import timeline
from ringtrain.engine.buckets import Plan
from ringtrain.engine.outer_codec import OuterCodec
from ringtrain.engine.steps.whole import BucketUpdates, tensor_bytes
from ringtrain.errors import ConfigError

log = logging.getLogger("ringtrain")

# Key under which DistributedOptimizer.state_dict() keeps this step's state.
STATE_KEY = "ringtrain_local_update"
# arXiv 2311.08105, section 3: Nesterov momentum outer optimizer.
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9

OuterFactory = Callable[[Sequence[torch.nn.Parameter]], torch.optim.Optimizer]


def nesterov(params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9."""
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


def parse_sync_every(value: Any) -> int | str:
    """``sync_every`` as given (an int, a numeric string, "auto", None/"off"/0 for
    synchronous training): an int >= 0 (0 = synchronous) or "auto"."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise _bad_sync_every(value)
    if isinstance(value, int):
        if value < 0:
            raise _bad_sync_every(value)
        return value
    text = str(value).strip().lower()
    if text in ("", "off", "none"):
        return 0
    if text == "auto":
        return "auto"
    try:
        number = int(text)
    except ValueError:
        raise _bad_sync_every(value) from None
    if number < 0:
        raise _bad_sync_every(value)
    return number


def outer_delay(delay: int, sync_every: int) -> int:
    """The overlapped exchange's delay in inner steps: ``delay`` (at most a round), or for 0 a
    quarter of the round, at least one step (streaming DiLoCo's few steps: about 3% more steps
    to the tiny LM's target than applying it at once, against twice for a whole round)."""
    return min(delay, sync_every) if delay > 0 else max(1, sync_every // 4)


def _bad_sync_every(value: Any) -> ConfigError:
    return ConfigError(
        f"sync_every must be a number of steps >= 0 or 'auto', got {value!r}\n"
        "HINT: 0 trains synchronously; 100 averages the weights every 100 local steps; 'auto' "
        "decides from the measured link and compute."
    )


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
    ) -> None:
        if sync_every < 1:
            raise _bad_sync_every(sync_every)
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
        self.codec = OuterCodec(outer_compression, self._wire)
        # Overlapped outer exchange (streaming DiLoCo's): see _start_exchange and _merge.
        self.overlap = overlap
        self.delay = outer_delay(delay, sync_every)
        self._base: list[torch.Tensor] | None = None  # this rank's weights when it was sent
        self._pending: concurrent.futures.Future[torch.Tensor] | None = None
        self._since_sent = 0  # inner steps taken since the exchange in flight started
        self._exchanger: concurrent.futures.ThreadPoolExecutor | None = None
        self.anchor: list[torch.Tensor] | None = None
        self.inner_steps = 0  # since the last outer step
        self.outer_steps = 0
        self._agree = True  # copy rank 0's anchor and outer state at the next outer step
        self.copies = 0  # how often that copy was needed (the ranks' digests differed)
        self.outer_seconds = 0.0  # wall time spent in outer steps (exchange included)

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
        return self.codec.bytes_sent

    # ---- the optimizer's calls ------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One inner step; every ``sync_every``-th, then the outer step."""
        if self.anchor is None:
            self.anchor = [p.detach().clone() for p in self._params]
        result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.inner_steps += 1
        if self._pending is not None:
            self._since_sent += 1
            if self._since_sent >= self.delay:
                self._timed("OUTER_MERGE", self._merge)
        if self.inner_steps >= self.sync_every:
            self.outer_step()
        return result

    def outer_step(self) -> None:
        """Average the change since the anchor and step the outer optimizer (collective);
        overlapped: start that average, applied ``delay`` inner steps later."""
        if self.overlap and self._wire.size > 1:
            self._timed("OUTER_STEP", self._start_exchange)
        else:
            self._timed("OUTER_STEP", self._synchronous_step)

    def _timed(self, name: str, part: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        part()
        t1 = time.perf_counter()
        self.outer_seconds += t1 - t0
        timeline.current().span("step", name, t0, t1)

    def _synchronous_step(self) -> None:
        """This round's change averaged now, and the anchor stepped with it."""
        with torch.no_grad():
            if self.anchor is None:
                self.anchor = [p.detach().clone() for p in self._params]
            if self._agree and self._wire.size > 1:
                self._copy_from_root()
            self._agree = False
            self._step_anchor(self.codec.average(self._change()))
        self.inner_steps = 0
        self.outer_steps += 1

    def _start_exchange(self) -> None:
        """The overlapped outer step's first half: this round's change, ``anchor - weights``,
        starts travelling in the background and the inner steps go on from these weights;
        :meth:`_merge` applies its average ``delay`` inner steps later."""
        with torch.no_grad():
            if self._pending is not None:  # outer_step() called before the average was due
                self._merge()
            if self.anchor is None:
                self.anchor = [p.detach().clone() for p in self._params]
            if self._agree:
                self._copy_from_root()  # nothing in flight: the wire is free
            self._agree = False
            change = self._change()
            self._base = [p.detach().clone() for p in self._params]
            if self._exchanger is None:
                self._exchanger = concurrent.futures.ThreadPoolExecutor(1, "ringtrain-outer")
            self._pending = self._exchanger.submit(self.codec.average, change)
            self._since_sent = 0
        self.inner_steps = 0
        self.outer_steps += 1

    def _merge(self) -> None:
        """The overlapped outer step's second half, ``delay`` inner steps after the first, at
        the same step on every rank: the average, waited for in full, steps the anchor, and
        each rank continues from the new anchor plus its own progress since it sent (which
        belongs to the next round's change). What is applied never depends on when the
        exchange finished."""
        assert self._pending is not None and self._base is not None
        mean = self._pending.result()
        self._pending = None
        with torch.no_grad():
            progress = [p.detach() - b for p, b in zip(self._params, self._base)]
            self._base = None
            self._step_anchor(mean)
            for p, d in zip(self._params, progress):
                p.add_(d)

    def _change(self) -> torch.Tensor:
        """``anchor - weights`` of every averaged parameter, flat, float32, in host memory: the
        outer exchange goes over the engine's Gloo group, and its codec, its error feedback
        and the background exchange then never touch a GPU stream."""
        assert self.anchor is not None
        return torch.cat(
            [
                (a.float() - p.detach().float()).reshape(-1)
                for a, p in zip(self.anchor, self._params)
            ]
        ).cpu()

    def _step_anchor(self, mean: torch.Tensor) -> None:
        """The outer optimizer steps the anchor with ``mean`` as its gradient (leaves the
        parameters holding the new anchor)."""
        assert self.anchor is not None
        saved = [p.grad for p in self._params]
        offset = 0
        for a, p in zip(self.anchor, self._params):
            n = p.numel()
            p.copy_(a)
            p.grad = mean[offset : offset + n].view_as(p).to(p.device, p.dtype)
            offset += n
        with torch.enable_grad():
            self.outer.step()
        for p, g in zip(self._params, saved):
            p.grad = g
        self.anchor = [p.detach().clone() for p in self._params]

    def _wait_pending(self) -> torch.Tensor | None:
        """The exchange in flight, waited for (a checkpoint holds its result)."""
        if self._pending is None:
            return None
        mean = self._pending.result()
        self._pending = concurrent.futures.Future()
        self._pending.set_result(mean)
        return mean

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
        itself; copy them before the next step). ``agreed``: see :attr:`agreed`."""
        pending = self._wait_pending()

        def own(ts: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if ts is None else [t.clone() if copy else t for t in ts]

        codec = self.codec.state_dict()
        if copy and codec["residual"] is not None:
            codec["residual"] = codec["residual"].clone()
        return {
            "version": 2,
            "sync_every": self.sync_every,
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "agreed": self.agreed,
            "anchor": own(self.anchor),
            "outer": self.outer.state_dict(),
            "codec": codec,
            "overlap": {
                "base": own(self._base),
                "pending": None if pending is None else pending.clone() if copy else pending,
                "since_sent": self._since_sent,
            },
        }

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") not in (1, 2):
            raise ConfigError(
                f"this is not a local-update v1 or v2 state (keys {sorted(state)}).\n"
                "HINT: resume with the ringtrain version that wrote the checkpoint."
            )
        anchor = state.get("anchor")
        if anchor is not None and [a.shape for a in anchor] != [p.shape for p in self._params]:
            raise ConfigError(
                "the saved local-update anchor does not match this model's parameters.\n"
                "HINT: load the checkpoint into the model it was saved from."
            )

        # Own copies on the parameters' device (a checkpoint's tensors come from host memory).
        def here(ts: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return (
                None
                if ts is None
                else [t.to(p.device, copy=True) for t, p in zip(ts, self._params)]
            )

        self.anchor = here(anchor)
        self.inner_steps = int(state.get("inner_steps", 0)) % self.sync_every
        self.outer_steps = int(state.get("outer_steps", 0))
        self.outer.load_state_dict(state["outer"])
        self.codec.load_state_dict(state["codec"], torch.device("cpu"))  # see _change
        self._agree = True
        saved = state.get("overlap") or {}
        pending = saved.get("pending")
        # v1 applied the average one round late: its "ref" is the weights when it was sent.
        self._base = here(saved.get("base", saved.get("ref")))
        self._since_sent = int(saved.get("since_sent", self.inner_steps))
        self._pending = None
        if pending is not None:
            self._pending = concurrent.futures.Future()
            self._pending.set_result(pending.to("cpu", copy=True))

    def restart(self) -> None:
        """Start afresh from the current weights (a checkpoint without local-update state was
        loaded): the next step takes them as the anchor; fresh outer optimizer and error
        feedback; the next outer step agrees on the anchor."""
        self._drop_pending()
        self.anchor = None
        self.inner_steps = 0
        self.outer = self._factory(self._params)
        self.codec.residual = None
        self._agree = True

    def rejoin(self, group: Any) -> None:
        """Elastic: the world was re-formed. Every rank starts a new round of ``sync_every``
        inner steps; the next outer step copies rank 0's anchor and outer state first, so all
        ranks, joined ones too, hold the same weights after it. Error feedback starts afresh."""
        self._drop_pending()
        self._wire.close()
        self._wire = transport.of(group)
        self.codec = OuterCodec(self._compression, self._wire)
        self.inner_steps = 0
        self._agree = True

    def close(self) -> None:
        self._drop_pending(settle=False)  # the wire closes: nothing uses it after
        self._wire.close()
        if self._exchanger is not None:
            self._exchanger.shutdown(wait=False)

    def _drop_pending(self, settle: bool = True) -> None:
        """Elastic, a restart or closing: the exchange in flight is given up on every rank
        alike (not applied on some ranks only); its change is still in each rank's weights,
        and travels with the next outer step's. ``settle``: it may still be using the wire,
        which stays in use, so it is let end first (on a whole world it completes; where a
        rank is gone, the wire fails it at once or at the group's timeout); closing does not
        wait, the wire closes under it."""
        if settle and self._pending is not None:
            concurrent.futures.wait([self._pending])
        self._pending = None
        self._base = None
        self._since_sent = 0

    # ---- agreeing on the anchor -----------------------------------------------------------------

    def _copy_from_root(self) -> None:
        """Every rank takes rank 0's anchor and outer optimizer state (serialized, so a rank
        that joined without outer state gets it whole), unless every rank's digest of them is
        already rank 0's."""
        assert self.anchor is not None
        if _all_alike(self._wire, self._digest()):
            return
        self.copies += 1
        buf = io.BytesIO()
        if self._wire.rank == 0:
            torch.save({"anchor": self.anchor, "outer": self.outer.state_dict()}, buf)
        blob = _broadcast_bytes(self._wire, buf.getvalue())
        if self._wire.rank != 0:
            got = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            self.anchor = [a.to(p.device) for a, p in zip(got["anchor"], self._params)]
            self.outer.load_state_dict(got["outer"])

    def _digest(self) -> bytes:
        """SHA-256 of the anchor's and the outer optimizer state's bits (32 bytes)."""
        assert self.anchor is not None
        h = hashlib.sha256()
        tensors = list(self.anchor)
        state = self.outer.state_dict()["state"]  # keyed by parameter index
        for pid in sorted(state):
            for key in sorted(state[pid]):
                value = state[pid][key]
                h.update(f"{pid}:{key}".encode())
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
                else:
                    h.update(repr(value).encode())
        for t in tensors:
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.digest()


def _all_alike(wire: transport.Transport, digest: bytes) -> bool:
    """Whether every rank's ``digest`` is the same (an all-gather of 32 bytes a rank)."""
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    pieces = [mine if r == wire.rank else torch.empty_like(mine) for r in range(wire.size)]
    wire.allgather(pieces).wait()
    return all(torch.equal(p, pieces[0]) for p in pieces)


def _broadcast_bytes(wire: transport.Transport, data: bytes) -> bytes:
    """Rank 0's ``data`` on every rank, as an all-gather in which only rank 0's piece counts."""
    n, me = wire.size, wire.rank
    lengths = [torch.tensor([len(data) if r == me else 0], dtype=torch.int64) for r in range(n)]
    wire.allgather(lengths).wait()
    size = int(lengths[0].item())
    # Equal pieces (a ring forwards every one); rare (a start, a resume, a re-form): the waste
    # of n-1 empty copies does not matter.
    pieces = [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]
    if me == 0:
        pieces[0] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    wire.allgather(pieces).wait()
    return bytes(pieces[0].numpy().tobytes())


# ---- choosing it (ringtrain.engine.gradient_path) -----------------------------------------------


def check(config: Config) -> None:
    """Local updates with settings that make no sense with them: a clear error."""
    every = parse_sync_every(config.sync_every)
    if config.outer_delay and not config.outer_overlap:
        raise ConfigError(
            f"outer_delay={config.outer_delay} says how many inner steps the overlapped outer "
            "exchange may take, but outer_overlap is off.\nHINT: add outer_overlap=True, or "
            "drop outer_delay."
        )
    if isinstance(every, int) and every > 0 and config.outer_delay > every:
        raise ConfigError(
            f"outer_delay={config.outer_delay} is longer than a round (sync_every={every}): "
            "each average must be applied before the next round's exchange starts.\nHINT: "
            f"outer_delay={every} at most (or 0: a quarter of the round)."
        )
    clash = clashes(config)
    if isinstance(every, int) and every > 0 and clash:
        raise ConfigError(
            f"sync_every={every} (local updates) cannot be combined with {clash}: no "
            "gradient is exchanged between outer steps, so there is nothing to shard or "
            f"overlap.\nHINT: drop {clash}, or sync_every."
        )


def clashes(config: Config) -> str:
    """The settings of ``config`` that make no sense with local updates ("" when none)."""
    on = (("shard_optimizer", config.shard_optimizer), ("overlap", config.overlap))
    return " and ".join(name for name, value in on if value)


def auto_compression(compression: Any, config: Config) -> Any:
    """``sync_every="auto"`` measures with ``compression="auto"``'s measurement: the
    compression to use (an explicit other one is an error: nothing would measure)."""
    given = config.compression if compression is None else compression
    if given in ("auto", "none"):
        return "auto"
    raise ConfigError(
        f"sync_every='auto' decides from compression='auto''s measurement, but compression is "
        f"{given!r}.\nHINT: leave compression unset (or 'auto') with sync_every='auto', or set "
        "sync_every to a number of steps."
    )


def choose_after_tuning(tuner: Any, config: Config, set_rank: int) -> tuple[int, str]:
    """``sync_every="auto"``, once the compression is settled: the policy's choice
    (:func:`ringtrain.engine.auto.choose_sync_every`, on figures every rank holds alike) and
    why; rank 0 logs it. The weights are identical on every rank then: the anchor."""
    from ringtrain.engine.auto import choose_sync_every

    decision = tuner.auto.decision
    if tuner.measurement is None and tuner.auto.sync_every is not None:
        every = tuner.auto.sync_every  # restored from a checkpoint with the compression choice
        why = "restored from a checkpoint, as chosen when the job measured its link."
    elif tuner.measurement is None or decision is None:
        every, why = 0, "compression=auto settled without measuring (restored), so synchronous."
    else:
        every, why = choose_sync_every(tuner.measurement, decision.predicted_step_s)
        if every and clashes(config):
            every, why = 0, f"{why} But {clashes(config)} is set, so synchronous."
    tuner.auto.sync_every = every  # a checkpoint keeps it (AutoCompression.state_dict)
    if set_rank == 0:
        chosen = f"local updates every {every} steps" if every else "synchronous training"
        log.warning("ringtrain sync_every=auto chose %s: %s", chosen, why)
    return every, why
