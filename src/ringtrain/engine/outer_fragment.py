"""Fragments of a local-update step's parameters, each exchanged at its own step of the round.

Streaming DiLoCo (arXiv 2501.18512) does not average the whole model at the end of a round: it
cuts the parameters into ``P`` fragments and averages fragment ``f`` at inner step
``(f + 1) * H // P`` of every round of ``H`` steps, so the link carries ``1/P`` of the model at a
time, ``P`` times a round, and an overlapped exchange of one fragment has the delay's inner steps
to travel where the whole model would need ``P`` times that. Each fragment keeps its own error
feedback and its own exchange in flight; the anchor and the outer optimizer stay whole
(:class:`ringtrain.engine.local_update.LocalUpdate` steps a fragment's parameters only, the
others have no gradient for that step and an optimizer skips them).

Fragments are runs of whole parameters in the optimizer's order, about ``numel / P`` values each
(the paper's "sequential" pattern): a fragment's values are then a slice of the flat vector of
all parameters, so a whole-model state (error feedback, an average in flight) splits into the
fragments' by offsets.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import torch

from ringtrain import transport
from ringtrain.engine.outer_codec import OuterCodec
from ringtrain.errors import ConfigError
from ringtrain.runtime import abort


class Fragment:
    """Parameters ``first`` to ``stop - 1`` of a local-update step (see the module docstring)."""

    def __init__(self, index: int, first: int, stop: int, numel: int, end: int, codec: OuterCodec):
        self.index = index
        self.first, self.stop = first, stop
        self.numel = numel  # values in its parameters (its slice of the flat vector)
        self.end = end  # the inner step of the round (1 to sync_every) at which it is exchanged
        self.codec = codec  # its own error feedback
        self.base: list[torch.Tensor] | None = None  # its weights when its change was sent
        self.pending: concurrent.futures.Future[torch.Tensor] | None = None
        self.since_sent = 0  # inner steps taken since its exchange in flight started

    @property
    def indices(self) -> range:
        return range(self.first, self.stop)

    def finished(self) -> torch.Tensor | None:
        """Its exchange in flight, waited for (None when none is)."""
        if self.pending is None:
            return None
        mean = self.pending.result()
        self.pending = concurrent.futures.Future()
        self.pending.set_result(mean)
        return mean

    def restore(self, mean: torch.Tensor | None) -> None:
        """An average saved in flight, as already arrived."""
        self.pending = None
        if mean is not None:
            self.pending = concurrent.futures.Future()
            self.pending.set_result(mean.to("cpu", copy=True))

    def drop(self, settle: bool) -> None:
        """Give up its exchange in flight; ``settle``: let it end first (the wire stays in use).
        Not an exchange of a world the launcher replaced (elastic): a survivor that left that
        world first may never send its part, and the wait would last the transport timeout;
        that world's wire is closed when the ranks rejoin (``LocalUpdate.rejoin``)."""
        pending = self.pending
        while settle and pending is not None and not pending.done() and not abort.replaced():
            concurrent.futures.wait([pending], timeout=abort.SLICE_S)
        self.pending = None
        self.base = None
        self.since_sent = 0


def split(
    params: Sequence[torch.Tensor],
    count: int,
    sync_every: int,
    codec: str,
    wire: transport.Transport,
) -> list[Fragment]:
    """``count`` (at most ``sync_every``) fragments of ``params``: consecutive parameters,
    about equal in values, each at least one parameter; fragment ``f`` is exchanged at inner
    step ``(f+1) * sync_every // count`` (the last at the round's end)."""
    if count < 1:
        raise ConfigError(f"outer_fragments must be >= 1, got {count}")
    if count > len(params):
        raise ConfigError(
            f"outer_fragments={count}, but the model has only {len(params)} floating "
            "parameter(s) to cut (a fragment is whole parameters).\nHINT: outer_fragments="
            f"{max(1, len(params))} at most."
        )
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    bounds = [0]
    running = 0
    for i, n in enumerate(sizes):
        running += n
        f = len(bounds)  # the fragment this parameter may close
        left = len(params) - (i + 1)  # parameters still to place
        if f < count and (running * count >= f * total or left == count - f):
            bounds.append(i + 1)
    bounds.append(len(params))
    return [
        Fragment(
            f,
            bounds[f],
            bounds[f + 1],
            sum(sizes[bounds[f] : bounds[f + 1]]),
            sync_every * (f + 1) // count,
            OuterCodec(codec, wire),
        )
        for f in range(count)
    ]


def cut_flat(flat: torch.Tensor | None, fragments: Sequence[Fragment]) -> list[torch.Tensor | None]:
    """A whole-model flat vector (a state saved before fragments) as each fragment's slice."""
    if flat is None:
        return [None] * len(fragments)
    pieces = torch.split(flat, [f.numel for f in fragments])
    return [p.clone() for p in pieces]
