"""The stall inspector's policy, driven by plain numbers instead of sleeping."""

from __future__ import annotations

from ringtrain.diagnostics.stall import StallInspector, Waiting


def _waiting(since: float, submitted: tuple[int, ...] = (0, 2)) -> dict[str, Waiting]:
    return {"grad.fc.weight": Waiting("grad.fc.weight", submitted, since)}


def test_quiet_before_the_warning_time() -> None:
    v = StallInspector(60, 0).check(_waiting(since=0), set_size=3, now=59)
    assert not v.warning and not v.abort


def test_warning_names_missing_ranks_and_tensors() -> None:
    v = StallInspector(60, 0).check(_waiting(since=0), set_size=3, now=61, global_ranks=[0, 1, 2])
    assert "rank 1 has not submitted: 'grad.fc.weight'" in v.warning
    assert "submitted by ranks [0, 2]" in v.warning and "HINT" in v.warning
    assert not v.abort


def test_warns_once_per_interval() -> None:
    inspector = StallInspector(10, 0)
    assert inspector.check(_waiting(0), 3, now=11).warning
    assert not inspector.check(_waiting(0), 3, now=15).warning
    assert inspector.check(_waiting(0), 3, now=22).warning


def test_abort_after_shutdown_time() -> None:
    v = StallInspector(10, 30).check(_waiting(0), 3, now=31)
    assert "stopping the job" in v.abort and "rank 1" in v.abort


def test_disabled_with_zero_warning_time() -> None:
    assert StallInspector(0, 0).check(_waiting(0), 3, now=1e9) == StallInspector(0, 0).check(
        {}, 3, 0
    )


def test_global_rank_translation_for_process_sets() -> None:
    v = StallInspector(1, 0).check(_waiting(0, submitted=(0,)), 2, now=5, global_ranks=[4, 6])
    assert "rank 6 has not submitted" in v.warning and "submitted by ranks [4]" in v.warning
    # A set other than the world's is named: one name may be in use on several sets.
    assert v.warning.startswith("stall: 1 collective(s)")
    v = StallInspector(1, 0).check(_waiting(0, submitted=(0,)), 2, 5, [4, 6], set_id=3)
    assert v.warning.startswith("stall on process set 3 (ranks [4, 6]): 1 collective(s)")


def test_a_shutdown_time_below_the_warning_time_stops_at_the_time_it_names() -> None:
    """--stall-shutdown-time 30 with the default 60 s warning: the job stops at 30 s (Horovod
    would log that it never stops; docs/diagnostics.md says every rank raises after it)."""
    inspector = StallInspector(60, 30)
    assert inspector.watch_from_s == 30
    assert inspector.check(_waiting(0), 3, now=29) == StallInspector(0, 0).check({}, 3, 0)
    v = inspector.check(_waiting(0), 3, now=31)
    assert "stopping the job" in v.abort and "rank 1 has not submitted" in v.abort
    # Every name of the setting, not only ringtrain's variable: it may have come from any.
    assert "(--stall-shutdown-time, RINGTRAIN_STALL_SHUTDOWN_S, HOROVOD_STALL_SHUTDOWN" in v.abort


def test_only_names_past_the_warning_time_are_warned_of() -> None:
    waiting = {**_waiting(0), "late": Waiting("late", (0,), 45)}
    v = StallInspector(10, 100).check(waiting, 3, now=50)
    assert "'grad.fc.weight'" in v.warning and "'late'" not in v.warning
    assert StallInspector(10, 0).watch_from_s == 10
