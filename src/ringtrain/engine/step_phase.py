"""Where one DistributedOptimizer's step is: which gradients came, and what ran since."""

from __future__ import annotations

import enum
import time

import torch

from ringtrain.diagnostics import timeline
from ringtrain.errors import StepOrderError


class Phase(enum.Flag):
    IDLE = 0
    OPEN = enum.auto()  # a gradient came since the last synchronize
    READY = enum.auto()  # some gradient reached backward_passes_per_step
    SYNCHRONIZED = enum.auto()  # synchronize() ran since the last step()
    IN_PASS = enum.auto()  # timeline only: inside a backward pass


class StepProgress:
    """The step's phase, the backward passes each gradient has seen, and the gradients that
    came sparse and go back sparse (``sparse_as_dense``)."""

    def __init__(self, n: int) -> None:
        self.phase = Phase.IDLE
        self.counts = [0] * n
        self.sparse_back: set[int] = set()
        self.syncs = 0  # synchronize() calls: the step number the wait watch posts
        self._pass_start = 0.0

    def __contains__(self, flag: Phase) -> bool:
        return bool(self.phase & flag)

    def set(self, flag: Phase, on: bool = True) -> None:
        self.phase = self.phase | flag if on else self.phase & ~flag

    def restart(self, n: int) -> None:
        """Forget everything (a new parameter list, an elastic rejoin)."""
        self.phase = Phase.IDLE
        self.counts = [0] * n
        self.sparse_back.clear()

    def ended(self) -> None:
        """The step's exchange ended: the next gradient opens the next step. A backward that
        raised never ran its end callback, so IN_PASS goes too."""
        self.counts = [0] * len(self.counts)
        self.sparse_back.clear()
        self.set(Phase.OPEN | Phase.READY | Phase.IN_PASS, False)

    def count(self, index: int, passes: int, name: str) -> bool:
        """One more backward pass of gradient ``index``; True when it reached ``passes``."""
        n = self.counts[index] + 1
        if n > passes:
            raise StepOrderError(
                f"gradient of {name!r} was computed again before step().\n"
                "HINT: call optimizer.step() (or synchronize()) between backward passes, or set "
                "backward_passes_per_step to the number of backward passes per step."
            )
        self.counts[index] = n
        if n < passes:
            return False
        self.set(Phase.READY)
        return True

    def start_pass(self) -> None:
        """Timeline: span the backward pass this gradient came in."""
        if Phase.IN_PASS in self or not timeline.current().enabled:
            return
        self.set(Phase.IN_PASS)
        self._pass_start = time.perf_counter()
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)
        except RuntimeError:  # not inside a backward pass (a hook fired by hand)
            self.set(Phase.IN_PASS, False)

    def _end_pass(self) -> None:
        self.set(Phase.IN_PASS, False)
        timeline.current().span("compute", "BACKWARD", self._pass_start, time.perf_counter())
