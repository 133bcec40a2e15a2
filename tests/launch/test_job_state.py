"""The supervisor's job state (launch/job_state.py): every decision on an event, without a
process. (The launcher's classes within 20 attributes: tests/test_source_shape.py.)"""

from __future__ import annotations

import pytest

from ringtrain.launch import job_state as js
from ringtrain.launch.failures import Failure

A = js.Action


def _failure(rank: int = 1, code: int = 3) -> Failure:
    return Failure(rank, "h0", code, f"rank {rank} exited with code {code}", [], at=1.0)


def _run(*events: js.Event, state: js.State | None = None) -> tuple[js.State, list[js.Action]]:
    state = state if state is not None else js.Starting()
    actions: list[js.Action] = []
    for e in events:
        d = js.on(state, e)
        state = d.state
        actions += d.actions
    return state, actions


def test_a_job_starts_runs_and_is_done_with_the_code_given() -> None:
    state, actions = _run(js.Started())
    assert state == js.Running() and state.phase is js.Phase.RUNNING and actions == []
    assert _run(js.AgentsEnded(0), state=state)[0] == js.Done(0)


def test_a_failure_stops_every_rank_once_and_kills_agents_past_the_deadline() -> None:
    first, later = _failure(1), _failure(2, code=1)
    state, actions = _run(js.Started(), js.Failed(first, now=10.0, grace_s=5.0))
    assert state == js.Stopping(first, deadline=10.0 + 5.0 + js.KILL_AFTER_S)
    assert actions == [A.STOP_RANKS] and js.stopping(state)
    # A later failure changes nothing: the first one acted on stays (the report orders them).
    assert _run(js.Failed(later, now=11.0, grace_s=5.0), state=state) == (state, [])
    assert _run(js.Tick(now=17.0), state=state) == (state, [])
    past, actions = _run(js.Tick(now=18.5), state=state)
    assert actions == [A.KILL_AGENTS] and past.deadline == 18.5 + js.KILL_AGAIN_S  # type: ignore[union-attr]


def test_a_launch_error_stops_at_once_even_while_stopping() -> None:
    hard = js.Failed(_failure(), now=3.0, grace_s=0.0, hard=True)
    state, actions = _run(hard)
    assert state == js.Stopping(_failure(), 3.0 + js.KILL_AFTER_S)
    assert actions == [A.STOP_RANKS_NOW]  # no notice for the peers: the ranks may not run yet
    slow = js.Stopping(None, deadline=100.0, interrupts=1)
    state, actions = _run(hard, state=slow)
    assert state == js.Stopping(None, 3.0 + js.KILL_AFTER_S, 1)
    assert actions == [A.STOP_RANKS_NOW]


def test_ctrl_c_forwards_sigint_then_a_second_kills_at_once() -> None:
    state, actions = _run(js.Started(), js.Interrupted(1, now=0.0, grace_s=5.0))
    forwarded = js.Stopping(None, 5.0 + js.KILL_AFTER_S, 1, kill_at=5.0)
    assert state == forwarded and actions == [A.FORWARD_SIGNAL]
    assert _run(js.Interrupted(1, now=1.0, grace_s=5.0), state=state) == (state, [])  # seen
    state, actions = _run(js.Interrupted(2, now=1.0, grace_s=5.0), state=state)
    assert state == js.Stopping(None, 1.0 + js.KILL_AFTER_S, 2) and actions == [A.KILL_RANKS]


def test_ranks_are_killed_once_when_the_grace_period_ends_never_sent_sigterm_again() -> None:
    state, _ = _run(js.Started(), js.Interrupted(1, now=0.0, grace_s=30.0))
    assert _run(js.Tick(now=29.9), state=state) == (state, [])
    state, actions = _run(js.Tick(now=30.0), state=state)
    assert actions == [A.KILL_RANKS] and state.kill_at is None  # type: ignore[union-attr]
    assert _run(js.Tick(now=31.0), state=state) == (state, [])
    # A second signal after that kills nothing more (nor is said to have killed them at once).
    assert _run(js.Interrupted(2, now=31.0, grace_s=30.0), state=state)[1] == []
    assert _run(js.Tick(now=33.5), state=state)[1] == [A.KILL_AGENTS]  # agents that hang


def test_ctrl_c_after_a_failure_keeps_the_failure() -> None:
    failing = js.Stopping(_failure(), deadline=50.0)
    state, actions = _run(js.Interrupted(1, now=2.0, grace_s=5.0), state=failing)
    assert state.failure == _failure() and actions == [A.FORWARD_SIGNAL]  # type: ignore[union-attr]


def test_elastic_worlds_re_form_wait_for_hosts_and_settle() -> None:
    lost = _failure()
    state, _ = _run(js.Started(), js.WorldChanged(1))
    assert state == js.Reforming(1) and state.phase is js.Phase.REFORMING
    assert _run(js.Settled(), state=state)[0] == js.Running()
    waiting, _ = _run(js.BelowMinNp(now=20.0, failure=lost), state=state)
    assert waiting == js.WaitingForHosts(20.0, lost)
    # A second loss while waiting keeps the first cause and the time the wait began.
    again = js.BelowMinNp(now=25.0, failure=_failure(2))
    assert _run(again, js.WorldChanged(2), state=waiting)[0] == waiting
    assert js.on(waiting, js.Tick(now=29.0, elastic_timeout_s=10.0)).timed_out is None
    late = js.on(waiting, js.Tick(now=31.0, elastic_timeout_s=10.0))
    assert late.timed_out is lost and late.state == waiting
    assert _run(js.Settled(), state=waiting)[0] == js.Running()  # a host came in time


def test_nothing_but_the_end_changes_a_job_that_is_done() -> None:
    done = js.Done(3)
    for e in (js.Started(), js.Failed(_failure(), 0.0, 1.0), js.Interrupted(1, 0.0, 1.0)):
        assert js.on(done, e) == js.Decision(done)


@pytest.mark.parametrize("phase", list(js.Phase))
def test_each_phase_has_its_state_class(phase: js.Phase) -> None:
    classes = [js.Starting, js.Running, js.Reforming, js.WaitingForHosts, js.Stopping, js.Done]
    assert [c.phase for c in classes].count(phase) == 1
