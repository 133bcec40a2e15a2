"""A bare ``sync_every=H``'s outer exchange where the user left it to ringtrain (issue 40 item 1).

``sync_every="auto"`` measures the link while training synchronously; a bare ``sync_every=H``
exchanges nothing between rounds, so it measures during its first round instead: the wall time
between inner steps (each rank's median), and at the round's first outer exchange the link with
``sync_every="auto"``'s probe (:func:`ringtrain.engine.auto.probe_link`), every figure then
MAX-allreduced (:func:`ringtrain.engine.auto.slowest`) so every rank holds the same. The choice
is :func:`ringtrain.engine.local_policy.outer_settings`'s, the rule ``auto`` uses: on a slow link
``int4`` with error feedback, overlapped, its delay fitted to the predicted wire time; on a fast
link the Config's ``fp16`` in line, the same bits as without the measurement. A setting the user
gave (:meth:`ringtrain.config.Config.given`) wins and is named in the log line; where both
``outer_compression`` and ``outer_overlap`` were given there is nothing to choose and nothing is
measured. The first round's exchange already uses the choice.

``sync_every="auto"`` starts the same way and decides on the same figures
(:mod:`ringtrain.engine.local_first`): ``H``, or synchronous training after this round.

The probe itself is queued at the round's first inner step, on the outer exchange's worker
(:meth:`FirstRound.start_probe`): the link is idle while a round's inner steps run, so the probe
runs beside them, and the first outer exchange finds its figures ready instead of waiting 0.4-0.6
s for them at 10 Mbit/s. Every rank queues it at the same step, behind what the worker already
holds, so its collectives run in the same order everywhere; and, queued with
:meth:`ringtrain.transport.Hold.submit_beside`, every collective issued on that group from
another thread meanwhile (another optimizer's plan agreement or buckets, a GAN's two
optimizers stepping in turn) waits for it first, so it follows the probe on every rank instead
of meeting it in another order on each (which hung). Beside the steps, though, the probe
waits for the GIL and the CPU they hold: on loopback that read 510-1,000 MB/s where the same
probe alone reads 1,000, enough to make a fast link look slow. That wait is a few switch
intervals per collective, small only against a long probe: the figures stand where the probe's
throughput allreduces took at least :data:`TRUSTED_PROBE_S` (a slow link's do, about 0.15 s
each); else the link is fast, and the first outer exchange probes it again, alone, in a few
milliseconds. The figures are agreed over ranks, so every rank decides alike.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ringtrain.config import Config
from ringtrain.engine import local_first, local_policy
from ringtrain.engine.local_settings import given_outer

log = logging.getLogger("ringtrain")

# A probe run beside the inner steps stands if its throughput allreduces took this long: the
# GIL's waits (sys.getswitchinterval(), 5 ms, a few per collective) are then at most ~10% of it.
TRUSTED_PROBE_S = 0.1


def wanted(config: Config) -> bool:
    """Whether a bare ``sync_every=H`` measures its link: not both outer settings given."""
    return not (config.given("outer_compression") and config.given("outer_overlap"))


def choose(
    config: Config,
    numel: int,
    sync_every: int,
    compute_s: float,
    latency_s: float,
    bytes_per_s: float,
) -> local_policy.OuterSettings | None:
    """The outer exchange for local updates every ``sync_every`` steps of ``compute_s`` over a
    link of ``latency_s`` per collective and ``bytes_per_s``, the user's given settings kept;
    None: nothing measured to decide on (no compute timed), the Config's settings stand. Pure:
    equal figures, equal answer."""
    if compute_s <= 0 or bytes_per_s <= 0:
        return None
    return local_policy.outer_settings(
        numel, sync_every, compute_s, bytes_per_s, latency_s, *given_outer(config)
    )


def beside_stands(grad_bytes: int, bytes_per_s: float) -> bool:
    """Whether a probe run beside the inner steps that read ``bytes_per_s`` stands: its
    throughput allreduces (sized by :func:`~ringtrain.engine.auto.probe_bytes` at that rate)
    took at least :data:`TRUSTED_PROBE_S`. Pure: equal figures, equal answer."""
    from ringtrain.engine import auto  # auto imports the compression policy: only now

    return auto.probe_bytes(grad_bytes, bytes_per_s) >= TRUSTED_PROBE_S * bytes_per_s


def line(sync_every: int, outer: local_policy.OuterSettings) -> str:
    """The log line for a bare ``sync_every=H``'s outer exchange (rank 0 writes it)."""
    how = f"overlapped (delay {outer.delay})" if outer.overlap else "not overlapped"
    return (
        f"ringtrain sync_every={sync_every} outer exchange {outer.compression}, {how}: {outer.why}."
    )


class FirstRound:
    """The measurement of a bare ``sync_every=H``'s first round (see the module docstring)."""

    def __init__(self, config: Config, decides: bool = False) -> None:
        """``decides``: ``sync_every="auto"``'s first round, which also chooses ``H`` or
        synchronous training (:attr:`choice`)."""
        self.config = config
        self.decides = decides
        self.choice: local_first.Choice | None = None  # auto's, once made
        # The H of the rounds after this one (auto's choice), 0: synchronous training after
        # it; None: sync_every stands. left: the round that chose synchronous training ended.
        self.next_every: int | None = None
        self.left = False
        self.settled = False
        self.why = ""  # the choice and why, once made (LocalUpdate.outer_reason)
        self._last: float | None = None
        self._intervals: list[float] = []
        # The link probe's (latency, bytes per second), queued at the round's first step.
        self.probe: Future[tuple[float, float]] | None = None

    def start_probe(
        self,
        submit: Callable[..., Future[tuple[float, float]]],
        group: object,
        params: Sequence[torch.Tensor],
    ) -> None:
        """Queue the link probe for ``params``' float32 bytes (``submit``: the outer exchange's
        worker's), unless one is queued or the round is settled; :meth:`settle` takes its
        figures."""
        from ringtrain.engine import auto  # auto imports the compression policy: only now

        if self.probe is None and not self.settled:
            numel = sum(p.numel() for p in params)
            self.probe = submit(auto.probe_link, group, numel * 4)

    def tick(self) -> None:
        """An inner step begins: the wall time since the last one is a step's compute."""
        now = time.perf_counter()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last = now

    def settle(
        self, group: Any, numel: int, sync_every: int, rank: int, size: int
    ) -> local_policy.OuterSettings | None:
        """At the first outer exchange, on every rank alike (collective): probe, agree, choose,
        and rank 0 logs the choice. None: the Config's settings stand (or, deciding, auto chose
        synchronous training: :attr:`choice`)."""
        from ringtrain.engine import auto  # auto imports the compression policy: only now

        self.settled = True
        compute = statistics.median(self._intervals) if self._intervals else 0.0
        probe, self.probe = self.probe, None  # queued earlier on this worker
        figures = probe.result() if probe is not None else None
        if figures is None or not beside_stands(numel * 4, figures[1]):
            if figures is not None and rank == 0:
                log.info(
                    "ringtrain: the link probe beside the first round read %.1f MB/s, too fast "
                    "to time beside the steps; probing it again at the outer exchange",
                    figures[1] / 1e6,
                )
            figures = auto.probe_link(group, numel * 4)
        latency, throughput = figures
        # Slowest rank: MAX compute and latency, MAX of the inverse rate; the shortest round
        # (sync_every per rank): MAX of -H, so the fitted delay fits every rank's round.
        compute, latency, inverse, minus_h = auto.slowest(
            group, [compute, latency, 1.0 / throughput, -float(sync_every)]
        )
        if self.decides and self.choice is None:  # restored: the chosen H's exchange only
            return self._decide(numel, size, rank, compute, latency, 1.0 / inverse)
        outer = choose(self.config, numel, int(-minus_h), compute, latency, 1.0 / inverse)
        if outer is not None and rank == 0:
            log.warning("%s", line(sync_every, outer))
        return outer

    def _decide(
        self, numel: int, size: int, rank: int, compute: float, latency: float, bps: float
    ) -> local_policy.OuterSettings | None:
        """sync_every="auto"'s choice on the agreed figures (:attr:`choice`), logged by rank 0;
        the outer exchange it chose (None: synchronous)."""
        fusion = self.config.fusion_threshold_bytes
        if compute <= 0:  # no inner step timed (a round of one step): nothing to weigh
            self.choice = local_first.Choice(0, "no inner step was timed: synchronous.", None)
        else:
            m = local_first.measurement(numel, size, fusion, compute, latency, bps)
            self.choice = local_first.decide(self.config, m)
        if rank == 0:
            log.warning("%s", local_first.line(self.choice))
        return self.choice.outer
