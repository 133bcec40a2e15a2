"""What a durable job's ranks agree on between steps, and at which steps: whether a rank was
asked to stop (SIGTERM, :mod:`.preemption`) and whether rank 0's clock says a save is due (a
schedule in seconds).

One small allreduce (three numbers) answers both for every rank. On a 2-core machine it cost
about 2 ms of a step's wall time, as much as raw Gloo's own ``all_reduce`` of two numbers, so it
is not run every step: rank 0 measures the steps and picks the next gap so that checks come
about every ``EVERY_S`` (every step where steps take that long). Its choice travels in the check
itself, so every rank knows the same check steps. A check's answer is read at the next check,
where the next one is asked: meanwhile it runs beside the steps, and nothing waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringtrain.checkpoint import api

if TYPE_CHECKING:
    import torch

    from ringtrain.collectives.handles import Handle

EVERY_S = 0.25  # between checks: a stop comes within about twice this (ask, then answer)
MOST_STEPS = 1000  # between checks, however short the steps
NAME = "ringtrain.checkpoint.durable"


@dataclass(frozen=True)
class Agreed:
    """A check's answer, the same on every rank."""

    on_clock: bool  # rank 0's clock said a save is due
    stopping: int  # how many ranks were asked to stop (SIGTERM)


class StepChecks:
    """The checks of one durable job (see the module docstring)."""

    def __init__(
        self, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = every_s
        self._clock = clock  # rank 0's, which measures the steps
        self._asked: Handle[torch.Tensor] | None = None
        self._world = (0, 0)  # the world the check in flight was asked in
        self._next: int | None = None  # the step of the next check (None: the next call)
        self._since: tuple[int, float] | None = None  # rank 0: the last check's step and time

    def at(self, step: int, on_clock: bool, stop: bool) -> Agreed | None:
        """At optimizer step ``step``, on every rank: None where this is no check step; else
        asks this step's check (this rank's part: ``on_clock``, rank 0's only, and ``stop``) and
        returns the previous check's answer (nothing asked yet, or asked in a world since
        re-formed: nothing agreed)."""
        from ringtrain.collectives import ops, reduce_ops

        rank, _, _ = api._where()
        world = api.world()
        if self._next is not None and step < self._next and world == self._world:
            return None
        got = None
        if self._asked is not None and world == self._world:
            got = ops.synchronize(self._asked)
        import torch

        mine = torch.tensor([int(on_clock and rank == 0), int(stop), self._gap(step, rank)])
        self._asked = ops.allreduce_async(mine, op=reduce_ops.Sum, name=NAME)
        self._world = world
        self._next = step + (int(got[2]) if got is not None else 1)
        return Agreed(bool(got[0]), int(got[1])) if got is not None else Agreed(False, 0)

    def _gap(self, step: int, rank: int) -> int:
        """Rank 0's choice of the steps between the next two checks (0 on other ranks)."""
        if rank != 0:
            return 0
        now, since = self._clock(), self._since
        self._since = (step, now)
        if since is None or step <= since[0]:
            return 1
        per_step = (now - since[1]) / (step - since[0])
        return max(1, min(MOST_STEPS, round(self.every_s / max(per_step, 1e-6))))

    def settle(self) -> None:
        """Wait for the check in flight: every rank asked it (the job ended, or stopped, at one
        step). Not where a peer may not have (after an error)."""
        asked, self._asked = self._asked, None
        if asked is not None and self._world == api.world():
            from ringtrain.collectives import ops

            ops.synchronize(asked)
