"""collectives/request_table.py without a process: what every rank decides alike from the table
(ready names, joined ranks standing in, the request cache's numbering)."""

from __future__ import annotations

from ringtrain.collectives.request_table import RequestTable
from ringtrain.collectives.requests import Request, TensorMeta

JOIN = "__join__"


def _req(name: str, numel: int = 4, kind: str = "allreduce") -> Request:
    return Request(name, kind, (TensorMeta((numel,), "float32"),), op="Sum")


def test_a_name_is_ready_once_every_rank_submitted_it() -> None:
    t = RequestTable(capacity=8)
    t.add(0, 0, [_req("a")], {}, now=1.0)
    assert not t.is_ready("a", 3, JOIN) and t.waits_on(0) and not t.waits_on(1)
    t.add(2, 2, [_req("a")], {}, now=2.0)
    t.add(1, 1, [_req("a")], {}, now=3.0)
    assert t.is_ready("a", 3, JOIN)
    assert t.waiting(now=5.0)["a"].since == 1.0  # the first sighting, not the last
    by_rank, payloads = t.take("a")
    assert sorted(by_rank) == [0, 1, 2] and payloads is None and not t and not t.first_seen


def test_the_stall_inspector_reads_only_names_waiting_long_enough() -> None:
    t = RequestTable(capacity=8)
    for now, name in ((1.0, "a"), (2.0, "b"), (3.0, "c")):
        t.add(0, 0, [_req(name)], {}, now=now)
    assert list(t.waiting(now=5.0, for_s=2.5)) == ["a", "b"]
    assert list(t.waiting(now=5.0)) == ["a", "b", "c"]
    t.add(1, 1, [_req("a")], {}, now=4.0)
    t.take("a")
    t.add(0, 0, [_req("a")], {}, now=4.0)  # seen again: now the newest
    assert list(t.waiting(now=7.0, for_s=3.5)) == ["b", "c"]
    assert t.waiting(now=7.0, for_s=3.5)["b"].submitted == (0,)


def test_joined_ranks_stand_in_for_others_but_not_for_the_join() -> None:
    t = RequestTable(capacity=8)
    t.add(1, 11, [_req(JOIN, 0, "join")], {}, now=0.0)
    assert t.joined == {1} and t.last_joined == 11
    t.add(0, 10, [_req("a")], {}, now=0.0)
    assert t.is_ready("a", 2, JOIN) and not t.is_ready(JOIN, 2, JOIN)
    assert t.alike("a", 2) is None  # with a rank joined, nothing rides the fast lane


def test_the_cache_numbers_requests_alike_in_the_order_they_ran() -> None:
    t = RequestTable(capacity=2)
    a, b, c = _req("a"), _req("b"), _req("c")
    for r in (a, a, b, c):  # a repeat keeps its number; the third is over the capacity
        t.remember({0: r, 1: r})
    assert t.cache == [a, b] and [t.cache_id(r) for r in (a, b, c)] == [0, 1, -1]
    t2 = RequestTable(capacity=8)
    t2.remember({0: a, 1: _req("a", numel=5)})  # ranks disagree: never cached
    t2.remember({0: _req(JOIN, 0, "join")})
    assert t2.cache == []


def test_a_failed_name_is_forgotten() -> None:
    t = RequestTable(capacity=8)
    t.add(0, 0, [_req("a")], {}, now=0.0)
    t.drop("a")
    assert not t and not t.first_seen and not t.inline


def test_a_message_names_cached_requests_by_number_and_carries_inline_data() -> None:
    t = RequestTable(capacity=8)
    a = _req("a")
    t.remember({0: a, 1: a})
    payload = ("float32", b"\x00" * 16)
    t.add(1, 1, [0, _req("b")], {1: payload}, now=0.0)
    assert t.by_name["a"] == {1: a} and t.inline == {"b": {1: payload}}
