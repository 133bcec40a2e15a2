"""Checkpoint benchmark: how long training is blocked per save, and how much a background write
slows the steps taken meanwhile.

Every rank trains a preset (default transformer-25m, Adam, sharded optimizer) and, per round,
takes ``steps`` steps right after an asynchronous save (:class:`ringtrain.checkpoint.
Checkpointer`), then waits for the write, then ``steps`` steps with nothing being written. A
step counts as *writing* when rank 0's write was in flight both when it started and when it ended,
and as *idle* when taken after the wait; rounds interleave the two, so both see the same machine
load. An untimed first save starts the writer (``writer``: its own process, the default, or a thread
of the rank) and makes its buffers. Reported: blocked time per save (the host copy, plus waiting for
the previous save, which never happens here since each round waits; also the slowest rank's per
save), the write's duration (save to commit), and step time writing vs idle, median [min-max], with
their ratio; and that ratio per round (each round's writing steps against its own idle steps, so a
change of the machine's load between rounds cancels), median [min-max] over rounds; and per round,
the time of all the steps after the save over that of the idle ones, which counts a write wherever
it fell (one shorter than a step leaves no step wholly inside it). Figures are rank 0's unless named
otherwise.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import ringtrain
import ringtrain.checkpoint
from ringtrain.bench.models import PRESETS
from ringtrain.bench.registry import register
from ringtrain.bench.stats import Summary, load_average, machine_info


@dataclass(frozen=True)
class CheckpointParams:
    model: str = "transformer-25m"
    rounds: int = 4  # saves measured
    steps: int = 6  # steps after each save, and again after its write finished
    batch_size: int | None = None
    shard: bool = True
    directory: str = ""  # a folder per run is made (and kept) inside it; default: a temporary one
    seed: int = 0
    writer: str = "process"  # Checkpointer(writer=...): "process" or "thread"


@dataclass
class CheckpointResult:
    params: CheckpointParams
    world_size: int
    checkpoint_bytes: int  # the committed checkpoint's files, all ranks
    blocked_s: Summary
    blocked_slowest_s: Summary  # per save, the most any rank was blocked
    copy_s: Summary  # of rank 0's blocked time, the copy into host memory
    copy_cpu_s: Summary  # the CPU time rank 0's process spent in it
    write_s: Summary
    step_idle_s: Summary
    step_writing_s: Summary
    slowdown: float  # median writing / median idle
    slowdown_rounds: Summary  # per round: its writing steps' median / its idle steps' median
    # Per round: the time of all its steps after the save / of its idle steps. A write shorter
    # than a step leaves no step wholly inside it; this counts it wherever it fell.
    after_save_rounds: Summary
    environment: dict[str, Any] = field(default_factory=dict)


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def _run_folder(directory: str) -> str:
    """A new folder for this run, inside ``directory`` (made if missing; checked by the command
    before any rank started) or a temporary one."""
    if directory:
        os.makedirs(directory, exist_ok=True)
    return tempfile.mkdtemp(prefix="ringtrain-bench-ckpt-", dir=directory or None)


@dataclass
class _Samples:
    """Rank 0's figures, a value per save (``blocked`` ... ``spans``) or per step."""

    blocked: list[float] = field(default_factory=list)
    copies: list[float] = field(default_factory=list)
    copies_cpu: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    writing: list[float] = field(default_factory=list)
    rounds: list[float] = field(default_factory=list)  # writing steps' median / idle steps'
    spans: list[float] = field(default_factory=list)  # all steps after the save / idle ones


def _measure_round(
    saver: ringtrain.checkpoint.Checkpointer, step: Callable[[], float], steps: int, got: _Samples
) -> None:
    """One round, right after a save: ``steps`` steps while it is written, the wait for the
    write, then ``steps`` idle steps."""
    started = time.perf_counter()
    got.blocked.append(saver.last_blocked_s)
    got.copies.append(saver.last_phases["copy"])
    got.copies_cpu.append(saver.last_phases["copy_cpu"])
    done_at = None
    mine: list[float] = []  # this round's steps taken while the write ran
    after: list[float] = []  # and all its steps after the save
    for _ in range(steps):
        before = saver.in_flight()
        s = step()
        after.append(s)
        if before and saver.in_flight():
            mine.append(s)
        elif done_at is None and not saver.in_flight():
            done_at = time.perf_counter()
    saver.wait()
    got.writes.append((done_at or time.perf_counter()) - started)
    ringtrain.barrier()
    calm = [step() for _ in range(steps)]
    got.spans.append(sum(after) / sum(calm))
    if mine:
        got.rounds.append(statistics.median(mine) / statistics.median(calm))
    got.writing += mine
    got.idle += calm


@register("checkpoint")
def bench_checkpoint(params: CheckpointParams) -> CheckpointResult:
    preset = PRESETS[params.model]
    torch.manual_seed(params.seed)
    model = preset.build()
    opt = ringtrain.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-4),
        named_parameters=model.named_parameters(),
        shard_optimizer=params.shard,
    )
    env = machine_info()  # its load_before: the load as the run starts
    gen = torch.Generator().manual_seed(params.seed + ringtrain.rank())
    batch = params.batch_size or preset.default_batch_size

    def step() -> float:
        x, y = preset.make_batch(batch, gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        preset.loss(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    # A folder of its own for every run, also inside a --dir the user gave: a checkpoint
    # directory holds one run (docs/checkpoint.md), so a second benchmark run there would be
    # refused the steps the first one saved.
    root: str = str(
        ringtrain.broadcast_object(_run_folder(params.directory))
        if ringtrain.rank() == 0
        else ringtrain.broadcast_object(None)
    )
    got = _Samples()
    try:
        for _ in range(2):
            step()  # the plan is learned, shards made
        with ringtrain.checkpoint.Checkpointer(root, keep=1, writer=params.writer) as saver:
            saver.save(0, model=model, optimizer=opt)  # untimed: starts the writer, makes buffers
            saver.wait()
            for r in range(params.rounds):
                saver.save(r + 1, model=model, optimizer=opt)
                _measure_round(saver, step, params.steps, got)
        size = _size(ringtrain.checkpoint.latest(root) or root)
        every = ringtrain.allgather_object(got.blocked)
        slowest = [max(b[i] for b in every) for i in range(len(got.blocked))]
    finally:
        ringtrain.barrier()
        if not params.directory and ringtrain.rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    writing, rounds, idle = got.writing, got.rounds, got.idle
    if not writing:
        writing = rounds = [float("nan")]
    ratio = Summary.of(writing).median / Summary.of(idle).median
    env["load_after"] = load_average()
    return CheckpointResult(
        params,
        ringtrain.size(),
        size,
        Summary.of(got.blocked),
        Summary.of(slowest),
        Summary.of(got.copies),
        Summary.of(got.copies_cpu),
        Summary.of(got.writes),
        Summary.of(idle),
        Summary.of(writing),
        ratio,
        Summary.of(rounds),
        Summary.of(got.spans),
        env,
    )


def format_checkpoint(res: CheckpointResult, markdown: bool = False) -> str:
    from ringtrain.bench.report import _load, table

    def ms(s: Summary) -> str:
        return f"{s.median * 1e3:.0f} [{s.min * 1e3:.0f}-{s.max * 1e3:.0f}]"

    p, r, a = res.params, res.slowdown_rounds, res.after_save_rounds
    rows = [
        ["blocked per save (ms)", ms(res.blocked_s), str(res.blocked_s.n)],
        ["  of which copying (ms)", ms(res.copy_s), str(res.copy_s.n)],
        ["  the copy's CPU time (ms)", ms(res.copy_cpu_s), str(res.copy_cpu_s.n)],
        [
            "blocked per save, slowest rank (ms)",
            ms(res.blocked_slowest_s),
            str(res.blocked_slowest_s.n),
        ],
        ["write, save to commit (ms, <=)", ms(res.write_s), str(res.write_s.n)],
        ["step, idle (ms)", ms(res.step_idle_s), str(res.step_idle_s.n)],
        ["step, write in flight (ms)", ms(res.step_writing_s), str(res.step_writing_s.n)],
        ["slowdown (writing / idle)", f"{res.slowdown:.2f}x", ""],
        ["slowdown per round", f"{r.median:.2f}x [{r.min:.2f}-{r.max:.2f}]", str(r.n)],
        ["steps after a save / idle, per round", f"{a.median:.2f}x [{a.min:.2f}-{a.max:.2f}]",
         str(a.n)],
    ]  # fmt: skip
    return "\n".join(
        [
            f"checkpoint: {p.model}, Adam, {'sharded' if p.shard else 'whole'} optimizer, "
            f"{res.world_size} ranks, the {p.writer} writer, "
            f"{res.checkpoint_bytes / 2**20:.0f} MiB per checkpoint, "
            f"{p.rounds} saves, median [min-max] of rank 0" + _load(res.environment),
            table(["what", "value", "samples"], rows, markdown),
        ]
    )
