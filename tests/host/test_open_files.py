"""The open-file limit the agent gives its ranks (host/open_files.py), on injected limits."""

from __future__ import annotations

import io
import json
import resource

import pytest

from ringtrain.environ import Ringtrain
from ringtrain.host import connections, open_files
from ringtrain.host.open_files import UNLIMITED, least, needed, plan, raise_for
from ringtrain.launch import agent


class FakeLimits:
    def __init__(self, soft: int, hard: int) -> None:
        self.limits = (soft, hard)
        self.calls: list[tuple[int, tuple[int, int]]] = []

    def get(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.limits

    def set(self, which: int, limits: tuple[int, int]) -> None:
        self.calls.append((which, limits))
        self.limits = limits


def test_the_need_is_the_models_most_files_and_headroom() -> None:
    assert needed(1024) == connections.most_files(1024) + open_files.HEADROOM
    assert needed(8) < 1024 < needed(1024)  # small jobs fit the usual soft limit


def test_a_soft_limit_below_the_need_is_raised_to_it() -> None:
    fake = FakeLimits(1024, 1 << 20)
    line = raise_for(1024, fake.get, fake.set)
    assert fake.calls == [(resource.RLIMIT_NOFILE, (needed(1024), 1 << 20))]
    assert line is not None and f"from 1024 to {needed(1024)}" in line and "1024 ranks" in line


def test_an_unlimited_hard_limit_gives_the_need_not_infinity() -> None:
    p = plan(1024, 1024, UNLIMITED)
    assert (p.new_soft, p.raised, p.short) == (needed(1024), True, False)


def test_enough_is_left_alone() -> None:
    for soft in (needed(1024), UNLIMITED):
        fake = FakeLimits(soft, UNLIMITED)
        assert raise_for(1024, fake.get, fake.set) is None
        assert fake.calls == []
    assert raise_for(8, FakeLimits(1024, 4096).get, FakeLimits(1024, 4096).set) is None


def test_a_hard_limit_between_the_least_and_the_need_is_taken() -> None:
    hard = needed(1024) - 1
    fake = FakeLimits(1024, hard)
    line = raise_for(1024, fake.get, fake.set)
    assert fake.limits == (hard, hard)
    assert line is not None and f"from 1024 to {hard}" in line


def test_a_hard_limit_below_the_least_is_taken_and_named() -> None:
    hard = least(1024) - 1
    fake = FakeLimits(1024, hard)
    line = raise_for(1024, fake.get, fake.set)
    assert fake.limits == (hard, hard)
    assert line is not None
    assert f"hard limit is {hard}" in line and "Too many open files" in line
    assert "ulimit -Hn" in line and "limits.conf" in line and "--ulimit nofile" in line
    # Already at the hard limit: nothing to set, the same warning.
    again = FakeLimits(hard, hard)
    assert raise_for(1024, again.get, again.set) == line
    assert again.calls == []


def test_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="at least 1 rank, got 0"):
        plan(0, 1024, 4096)


def test_the_agent_sizes_by_its_ranks_and_tells_the_launcher() -> None:
    out = io.StringIO()
    seen: list[int] = []

    def fake(size: int) -> str:
        seen.append(size)
        return f"raised for {size}"

    ranks = [{"rank": r, "env": {Ringtrain.SIZE: "1024"}, "argv": []} for r in (5, 6)]
    agent.Agent(out)._fit_open_files(ranks, fake)
    assert seen == [1024]
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [
        {"t": "note", "line": "raised for 1024"}
    ]
    quiet = io.StringIO()
    agent.Agent(quiet)._fit_open_files([{"rank": 0, "env": {}, "argv": []}], fake)
    assert quiet.getvalue() == "" and seen == [1024]  # no size (elastic): nothing
