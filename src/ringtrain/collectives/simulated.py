"""A simulated coordinator: the real controller's rounds at N ranks, in one process, no network.

What a negotiation round costs as the rank count grows cannot be measured on a 2-core machine
with real processes. This module drives one real :class:`~ringtrain.collectives.controller.
Controller` (its message building, the control channel's encoding and decoding, the table, the
ready check, the consistency check, the request cache, the shutdown votes) over a
:class:`CountingChannel`: a wire that delivers the N-1 peers' part of each round as copies of
this rank's, as the ranks of a program that submits the same collectives do, and counts what
a real transport would carry. Nothing runs on a data group: ready ops go to a
:class:`CountingExecutor`, which only counts them.

So a round's figures are this rank's own: the Python time of one round (the controller's code,
the copy into the slots excluded, as a real transport does that off the Python thread) and, from
the channel, the control bytes that reach the rank, the collectives it takes and the sequential
steps of those collectives (a ring allgather of N slots: N-1 steps; a vector round's recursive
doubling: log2 N allreduces on 2-rank groups, 2 more where N is not a power of two, each 2
steps bringing the vector's bytes). ``ringtrain bench coordinator`` prints
them (:mod:`ringtrain.bench.coordinator`). Both kinds of round can be
simulated: gathered (every rank's message) and vector rounds
(:mod:`~ringtrain.collectives.vector_round`; peers that mirror this rank AND to the same bits).

Limits: peers are this rank's mirror, so rounds where ranks differ (a stall, a mismatch, a rank
that joined) are not simulated; the time is this process's, on whatever else the machine runs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ringtrain.collectives.control_round import ControlChannel, Message
from ringtrain.collectives.controller import Controller
from ringtrain.collectives.execute import Pending
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.collectives.vector_round import VectorChannel
from ringtrain.config import Config
from ringtrain.host.connections import doubling_steps
from ringtrain.runtime.communicator import Communicator


@dataclass
class WireCounts:
    """What the simulated transport carried, summed over the rounds so far."""

    rounds: int = 0
    ops: int = 0  # collectives on the control group
    steps: int = 0  # sequential network steps of those collectives (ring allgather: N-1)
    bytes_in: int = 0  # control bytes that reach this rank
    decodes: int = 0  # per-rank messages this rank decoded (a counter of Python work)
    wire_s: float = 0.0  # time spent in the simulated wire itself, left out of Python time


class CountingChannel(ControlChannel):
    """The control channel over a simulated wire: peers mirror this rank (see module doc)."""

    def __init__(self, size: int, counts: WireCounts) -> None:
        self._size = size
        self._world = -1  # no group: _allgather is the simulated wire's
        self._slot = torch.zeros(_slot_bytes(), dtype=torch.uint8)
        self._slots = torch.zeros(size * _slot_bytes(), dtype=torch.uint8)
        self.rounds = 0
        self.started: float | None = None
        self.counts = counts

    def exchange(self, msg: Message) -> list[Message]:
        self.counts.rounds += 1
        out = super().exchange(msg)
        self.counts.decodes += len(out)
        return out

    def _allgather(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        started = time.perf_counter()
        out.view(self._size, -1).copy_(mine.view(1, -1).expand(self._size, -1))
        c = self.counts
        c.ops += 1
        c.steps += self._size - 1
        c.bytes_in += (self._size - 1) * mine.numel()
        c.wire_s += time.perf_counter() - started


class CountingVectors(VectorChannel):
    """The vector rounds' channel over a simulated wire: peers mirror this rank, so the AND of
    their vectors is this rank's; counted as the recursive doubling the real channel runs
    (this rank's steps on 2-rank groups, each a Gloo ring allreduce of 2 steps)."""

    def __init__(self, size: int, counts: WireCounts) -> None:
        self._size = size
        self._steps = [None] * len(doubling_steps(0, size)) if size > 1 else []
        self._world = -1
        self.rounds = 0
        self.started: float | None = None
        self.counts = counts

    def exchange(self, v: np.ndarray) -> np.ndarray:
        self.counts.rounds += 1
        self.counts.decodes += 1
        return super().exchange(v)

    def _allreduce(self, t: torch.Tensor, group: object) -> None:
        c = self.counts
        c.ops += 1
        c.steps += 2  # a 2-rank ring allreduce: reduce-scatter, then allgather
        c.bytes_in += t.numel() * t.element_size()  # half the vector in each step


class CountingExecutor:
    """Takes the ready ops of a round in place of the real executor and only counts them."""

    def __init__(self) -> None:
        self.ops = 0
        self.order: list[str] = []
        self.seconds = 0.0  # spent completing handles: the executor's work, not the round's

    def add(
        self,
        name: str,
        by_rank: Mapping[int, Request],
        local: Pending | None,
        *args: object,
        **kwargs: object,
    ) -> None:
        started = time.perf_counter()
        self.ops += 1
        self.order.append(name)
        if local is not None:
            local.handle.set_result(None)
        self.seconds += time.perf_counter() - started

    def flush(self) -> None:
        pass


def _slot_bytes() -> int:
    from ringtrain.collectives import control_round

    return control_round.CONTROL_SLOT_BYTES


@dataclass
class SimulatedRank:
    """Set rank 0 of an N-rank set, its controller driven round by round by the caller."""

    size: int
    vectors: bool = False  # vector rounds (collectives.vector_round), else gathered ones
    config: Config | None = None  # default: no fast lane, no stall reports
    controller: Controller = field(init=False)
    channel: CountingChannel = field(init=False)
    executor: CountingExecutor = field(init=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a simulated set needs at least 1 rank, got size={self.size}")
        if self.config is None:
            vector_from = 2 if self.vectors else 0
            self.config = Config(fast_lane=False, stall_warning_s=0, vector_rounds_from=vector_from)
        comm = Communicator(0, range(self.size), 0, {}, is_world=True)
        counts = WireCounts()
        self.channel = CountingChannel(self.size, counts)
        self.controller = Controller(
            comm,
            self.config,
            channel=self.channel,
            start=False,
            vectors=CountingVectors(self.size, counts),
        )
        self.executor = CountingExecutor()
        self.controller._executor = self.executor  # type: ignore[assignment]

    def submit(self, names: list[str], numel: int = 16384) -> None:
        """Submit one allreduce per name (float32 of ``numel``: 64 KiB by default, above the
        size whose data would travel inline in the round), as a program's call does: a name
        the set ran before with its cached request (collectives.resubmit), else a new one."""
        meta = (TensorMeta((numel,), "torch.float32"),)
        t = _tensor(numel)
        for name in names:
            req = self.controller.repeat_of(name, t, "Sum", 1.0, 1.0)
            self.controller.submit(req or Request(name, "allreduce", meta, op="Sum"), [t])

    def round(self) -> float:
        """One round; returns its Python seconds on this rank, the wire's copy and the
        executor's completion of the ready ops' handles (the same for either kind of round,
        and not negotiation) left out."""
        wire, done = self.channel.counts.wire_s, self.executor.seconds
        started = time.perf_counter()
        self.controller._cycle()
        spent = time.perf_counter() - started
        return spent - (self.channel.counts.wire_s - wire) - (self.executor.seconds - done)


_TENSORS: dict[int, torch.Tensor] = {}


def _tensor(numel: int) -> torch.Tensor:
    """One shared tensor per size: the controller never reads its data here."""
    if numel not in _TENSORS:
        _TENSORS[numel] = torch.zeros(numel)
    return _TENSORS[numel]


@dataclass(frozen=True)
class RoundFigures:
    """Per round, at one N, for one kind of round (idle, or carrying ``ops`` cached ops)."""

    size: int
    ops: int
    vectors: bool
    python_ms: float  # median Python time of a round on this rank
    bytes_in: int  # control bytes that reach this rank per round
    wire_ops: int  # control-group collectives per round
    steps: int  # their sequential network steps per round
    decodes: int  # messages decoded per round


def measure(size: int, ops: int, rounds: int = 20, vectors: bool = False) -> RoundFigures:
    """Median figures of ``rounds`` rounds at ``size`` ranks, each carrying ``ops`` cached ops
    (0: idle rounds). The ops ran once before, so they travel as cache numbers."""
    sim = SimulatedRank(size, vectors)
    names = [f"grad.{i}" for i in range(ops)]
    if ops:
        for _ in range(2):  # first full requests, then a gathered round follows those
            sim.submit(names)
            while sim.controller.pending_names():
                sim.round()
    before = WireCounts(**vars(sim.channel.counts))
    times = []
    for _ in range(rounds):
        if ops:
            sim.submit(names)
        times.append(sim.round())
    after = sim.channel.counts
    times.sort()
    return RoundFigures(
        size=size,
        ops=ops,
        vectors=vectors,
        python_ms=times[len(times) // 2] * 1e3,
        bytes_in=(after.bytes_in - before.bytes_in) // rounds,
        wire_ops=(after.ops - before.ops) // rounds,
        steps=(after.steps - before.steps) // rounds,
        decodes=(after.decodes - before.decodes) // rounds,
    )


def figures(
    sizes: tuple[int, ...] = (8, 64, 256, 1024),
    ops: tuple[int, ...] = (0, 64),
    rounds: int = 20,
) -> list[RoundFigures]:
    """Every (N, ops) with both kinds of round, measured side by side in one run."""
    return [measure(n, k, rounds, vectors) for n in sizes for k in ops for vectors in (False, True)]


def table(rows: list[RoundFigures]) -> str:
    """The figures as a markdown table, one row per (N, ops, kind of round)."""
    out = [
        "| ranks | cached ops | round | Python ms/round | control bytes in/round | ops | steps "
        "| decodes |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for f in rows:
        out.append(
            f"| {f.size} | {f.ops} | {'vector' if f.vectors else 'gathered'} | "
            f"{f.python_ms:.3f} | {f.bytes_in:,} | {f.wire_ops} | {f.steps} | {f.decodes} |"
        )
    return "\n".join(out)


if __name__ == "__main__":  # python -m ringtrain.collectives.simulated
    print(table(figures()))
