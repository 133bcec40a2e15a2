"""The straggler report's network hint knows the compression in force, and a window leaves out
compression="auto"'s measuring and trying steps (a new-user trial: auto had chosen topk over a
10 Mbit/s link, and the report at step 20 still said "send fewer bytes (--compression
fp16/powersgd/topk)", from a window that held auto's uncompressed measuring steps)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ringtrain.collectives import step_timing
from ringtrain.compression.policy import AutoCompression
from ringtrain.diagnostics.straggler import RankTimes, analyse
from ringtrain.engine.planner import Planner

# Two hosts, one rank each, at 10 Mbit/s: every step waits far longer than it computes.
SLOW = [RankTimes(0, "h0", 0.001, 0.02, 0.4), RankTimes(1, "h1", 0.001, 0.02, 0.4)]
LINKS = {"h0": 1.2, "h1": 1.2}
TOPK = "topk (chosen by compression='auto')"


@pytest.mark.parametrize("links", [LINKS, {"h0": 110.0, "h1": 110.0, "h2": 1.2}, {}])
def test_a_compressed_job_is_pointed_at_local_updates(links: dict[str, float]) -> None:
    times = [*SLOW, RankTimes(2, "h2", 0.001, 0.02, 0.4)] if "h2" in links else SLOW
    line = analyse(times, links, in_force=None, compression=TOPK).line()
    assert "network-bound" in line, line
    assert "--compression fp16/powersgd/topk" not in line, line  # what is already in use
    assert f"already compressed ({TOPK})" in line, line
    # The option's names as docs/engine.md and `ringtrain doctor` give them.
    assert "DistributedOptimizer(sync_every=H)" in line and "RINGTRAIN_SYNC_EVERY=auto" in line


def test_half_precision_is_offered_a_stronger_compression_too() -> None:
    line = analyse(SLOW, LINKS, in_force=None, compression="fp16").line()
    assert "--compression powersgd/topk" in line and "sync_every=H" in line, line
    assert "fp16/" not in line, line


def test_an_uncompressed_job_is_offered_compression_then_local_updates() -> None:
    for compression in (None, "none"):
        line = analyse(SLOW, LINKS, in_force=None, compression=compression).line()
        assert "--compression fp16/powersgd/topk" in line, line
        assert "already compressed" not in line and "sync_every=H" in line, line


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_auto_trial_steps_are_left_out_of_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 1-8 uncompressed and slow (auto measuring, then trying), 9-20 topk and faster:
    the report at step 20 holds only the chosen method's steps, and names it."""
    gathered: list[Any] = []

    def all_gather(outs: list[Any], obj: Any, group: Any) -> None:
        gathered.append(obj)
        outs[:] = [obj, RankTimes(1, "h1", obj.input_s, obj.compute_s, obj.wait_s)]

    monkeypatch.setattr(step_timing.group_ops, "size", lambda group: 2)
    monkeypatch.setattr(step_timing.group_ops, "rank", lambda group: 0)
    monkeypatch.setattr(step_timing.group_ops, "all_gather_object", all_gather)
    monkeypatch.setattr(step_timing, "probe_links", lambda group, hosts: dict(LINKS))
    clock = _FakeClock()
    timer = step_timing.StepTimer(20, 0, "h0", ["h0", "h1"], object(), clock=clock)
    try:
        for step in range(1, 21):
            trial = step <= 8
            timer.wait_started()
            clock.now += 2.0 if trial else 0.4  # the wait: uncompressed steps wait far longer
            timer.wait_done()
            clock.now += 0.02
            timer.step_done(compression="none" if step <= 4 else TOPK, trial=trial)
    finally:
        timer.close()
    report = step_timing.last_report()
    assert report is not None and len(gathered) == 1
    assert gathered[0].wait_s == pytest.approx(0.4), gathered[0]  # not (4 x 2.0 + 12 x 0.4) / 16
    assert f"already compressed ({TOPK})" in report.line(), report.line()


def test_the_planner_names_autos_choice_and_marks_its_steps() -> None:
    auto = AutoCompression()
    auto.use("topk")
    planner: Any = SimpleNamespace(compression=auto, _trial=True)
    assert Planner.compression_in_use(planner) == (TOPK, True)
    assert Planner.compression_in_use(planner) == (TOPK, False)  # the mark is the step's own
    planner.compression = AutoCompression()
    assert Planner.compression_in_use(planner)[0] == "none (chosen by compression='auto')"


def test_auto_that_chose_none_is_offered_compression() -> None:
    line = analyse(SLOW, LINKS, in_force=None, compression="none (chosen by compression='auto')")
    assert "already compressed" not in line.line() and "sync_every=H" in line.line()


def _train_with_auto() -> list[tuple[bool, str | None]]:
    """compression="auto" on real ranks, a report every 4 steps: each report's (whether auto
    had decided when it came, the compression it was given)."""
    import torch

    import ringtrain as rt
    from ringtrain.diagnostics import straggler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = rt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        compression="auto",
    )
    seen: list[tuple[bool, str | None]] = []

    def analyse_seen(*args: Any, **kwargs: Any) -> Any:
        seen.append((opt.auto_decision is not None, kwargs.get("compression")))
        return straggler.analyse(*args, **kwargs)

    step_timing.analyse = analyse_seen  # type: ignore[assignment]  # a spawned rank's own
    for _ in range(24):
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
    assert opt.auto_decision is not None
    return seen


def test_reports_under_auto_come_from_the_chosen_methods_steps(world2: Any) -> None:
    """Auto measures (and may try) over its first steps: a report due then waits for a window
    of the chosen method's steps, and names auto's choice."""
    results = world2.run(_train_with_auto, timeout=120, straggler_report_steps=4)
    assert results[0] == results[1] and results[0], results
    for decided, compression in results[0]:
        assert decided and compression is not None, results[0]
        assert compression.endswith("(chosen by compression='auto')"), compression
