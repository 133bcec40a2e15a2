"""The straggler report during real DistributedOptimizer training."""

from __future__ import annotations

import logging
import time

import torch

import ringtrain as rt
from ringtrain.collectives import step_timing
from ringtrain.testing.spawn import World


def _train(slow_rank: int, steps: int = 10) -> tuple[str, tuple[int, ...], str]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(16, 32)).pow(2).mean()
        if rt.rank() == slow_rank:
            time.sleep(0.12)  # as if this rank's cores were shared with another job
        loss.backward()
        opt.step()
    report = rt.straggler_report()
    assert report is not None
    return report.kind, report.ranks, report.line()


def test_a_rank_slow_in_compute_is_reported(world2: World) -> None:
    results = world2.run(_train, 1, timeout=90, straggler_report_steps=5)
    kind, ranks, line = results[0]
    assert all(r[:2] == (kind, ranks) for r in results)
    assert (kind, ranks) == ("compute", (1,)), line
    assert "rank 1" in line and "compute-bound" in line


def _train_at_shares() -> tuple[str, tuple[int, ...], tuple[float, ...] | None, str]:
    """Shares [3, 1] and the same speed per sample: rank 0 works three times as long."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        batch_shares=[3, 1],
    )
    for _ in range(10):
        opt.zero_grad()
        loss = model(torch.randn(16, 32)).pow(2).mean()
        time.sleep(0.15 if rt.rank() == 0 else 0.05)  # 0.05 s per share
        loss.backward()
        opt.step()
    report = rt.straggler_report()
    assert report is not None
    return report.kind, report.ranks, report.shares, report.line()


def test_the_report_compares_ranks_per_sample_at_the_shares_in_force(world2: World) -> None:
    results = world2.run(_train_at_shares, timeout=90, straggler_report_steps=5)
    kind, ranks, shares, line = results[0]
    assert all(r[:3] == (kind, ranks, shares) for r in results)
    assert (kind, ranks, shares) == ("shares", (0,), (0.75, 0.25)), line
    assert "(batch_shares in force [75, 25])" in line and "over the shares in force" in line


def _train_per_rank_steps() -> tuple[list[str], int]:
    """sync_every=[6, 2], both ranks as fast: rank 0's round takes three times rank 1's (twice
    was too close to the report's 1.25x under load: a window of two rounds in which rank 1
    was held back read as balanced). Rank 0 takes 36 steps, rank 1 12: a report at a step
    number would wait for a rank waiting for this one's next outer step (it hung); reports
    come at the ends of rounds instead."""
    assert rt.straggler_report() is None  # a new job: not the report of one before it
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 1)
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        sync_every=[6, 2],
        outer_compression="none",
    )
    lines = []
    for _ in range(36 if rt.rank() == 0 else 12):
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        time.sleep(0.03)  # the same compute per step on both ranks
        opt.step()
        report = rt.straggler_report()
        if report is not None and (not lines or report.line() != lines[-1]):
            lines.append(report.line())
    return lines, opt.local_update.outer_steps


def test_per_rank_inner_steps_report_per_round(world2: World) -> None:
    results = world2.run(_train_per_rank_steps, timeout=90, straggler_report_steps=4)
    (lines, rounds), (lines1, rounds1) = results
    assert rounds == rounds1 == 6 and lines == lines1
    # Every 2 rounds (4 steps of the shortest round): 3 reports, the first the same as the rest.
    assert lines and all("rank 0 on host" in x and "compute-bound" in x for x in lines), lines
    assert all("s/round" in x and "fewer inner steps a round in sync_every" in x for x in lines)


def _shut_down_late(late_s: float, wait_s: float, timeout_s: float) -> tuple[float, bool, str]:
    """Two steps since the last report (none is due before shutdown), then rank 1 comes to its
    shutdown ``late_s`` after rank 0 (a checkpoint it saves, an evaluation): how long rank 0's
    shutdown took, whether this rank holds a final report, and what it logged."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("ringtrain").addHandler(handler)
    kept = step_timing.FINAL_WAIT_S
    step_timing.FINAL_WAIT_S = wait_s
    try:
        rt.init(straggler_report_steps=100, timeout_s=timeout_s)
        try:
            model = torch.nn.Linear(8, 1)
            opt = rt.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.01),
                named_parameters=model.named_parameters(),
            )
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
            if rt.rank() == 1:
                time.sleep(late_s)
        finally:
            start = time.monotonic()
            rt.shutdown()
        return time.monotonic() - start, rt.straggler_report() is not None, "\n".join(said)
    finally:
        step_timing.FINAL_WAIT_S = kept
        logging.getLogger("ringtrain").removeHandler(handler)


def test_the_final_report_waits_for_a_late_rank_not_the_transport_timeout(world2: World) -> None:
    # Rank 1 comes 6 s late, past the 4 s transport timeout: rank 0's shutdown waited in the
    # report's all-gather until that timeout and dropped the report without a word. Now it
    # waits for rank 1 to come (it does, within the final wait) and both hold the report.
    (took, report, _), (_, report1, _) = world2.run(_shut_down_late, 6.0, 30.0, 4.0, init=False)
    assert report and report1
    assert 5.0 < took < 15.0, took


def test_the_final_report_is_given_up_alike_and_said_when_a_rank_is_too_late(
    world2: World,
) -> None:
    # Rank 1 comes 5 s late, the final wait is 1.5 s: rank 0 gives the report up at 1.5 s and
    # says why; rank 1 follows that decision at once (no all-gather alone), saying nothing.
    (took, report, said), (took1, report1, said1) = world2.run(
        _shut_down_late, 5.0, 1.5, 20.0, init=False, timeout=90
    )
    assert not report and not report1
    # Not the transport timeout (20 s); had rank 0 waited for rank 1 (5 s), both would hold
    # the report. Wide bounds: the machine may be loaded.
    assert took < 12.0, took
    assert took1 < 10.0, took1
    assert (
        "ringtrain: no final straggler report: ranks [1] did not call shutdown() within 1.5 s "
        "of rank 0 (still working, stuck, or gone)" in said
    ), said
    assert "final straggler report" not in said1, said1
