"""A named allreduce the set ran before is submitted with the request it made then
(collectives.resubmit, RequestTable.repeat_of): it builds no request of its own, lane or no
lane, and everything a new request would give still holds (results, mismatch reports, a
changed call). Also the request's own equality, hash and pickle, which the cache leans on."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch

import ringtrain as rt
from _repeats import N, check_spellings, counting, data, differing_calls
from ringtrain.collectives import async_ops, resubmit
from ringtrain.collectives.request_table import RequestTable
from ringtrain.collectives.requests import Request, TensorMeta
from ringtrain.testing import spawn

TIMEOUT = 150


def _req(name: str = "w", **changes: Any) -> Request:
    fields: dict[str, Any] = {"op": "Average", "prescale": 1.0, "postscale": 2.0}
    fields.update(changes)
    tensors = fields.pop("tensors", (TensorMeta((64, 64), "torch.float32"),))
    return Request(name, "allreduce", tensors, **fields)


def test_equal_requests_hash_alike_and_a_pickle_carries_no_worked_out_value() -> None:
    a, b = _req(), _req()
    assert a == b and a is not b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != _req(postscale=1.0) and a != _req("v") and a != "w"
    calls: list[Request] = []

    def compute(r: Request) -> int:
        calls.append(r)
        return len(calls) + 6

    assert a.derived("k", compute) == 7
    assert a.derived("k", compute) == 7  # worked out once
    assert calls == [a]
    state = a.__getstate__()
    assert "_hash" not in state and "_derived" not in state  # string hashes differ by process
    back = pickle.loads(pickle.dumps(a))
    assert back == a and "_derived" not in back.__dict__ and hash(back) == hash(a)


def test_a_request_s_equality_and_hash_take_every_field() -> None:
    # Request.__eq__ and requests._fields_of spell the fields out: a new field must join both.
    base = _req(root=0, splits=(1,), extra=(("k", "v"),))
    changed: dict[str, Any] = {
        "name": "v",
        "kind": "broadcast",
        "tensors": (),
        "op": "Sum",
        "root": 1,
        "prescale": 0.5,
        "postscale": 1.0,
        "splits": (2,),
        "shape_from_root": True,
        "error": "bad",
        "extra": (("k", "w"),),
    }
    assert set(changed) == {f.name for f in dataclasses.fields(Request)}
    for name, value in changed.items():
        other = dataclasses.replace(base, **{name: value})
        assert other != base and base != other and hash(other) != hash(base), name
        assert dataclasses.replace(base) == base and hash(dataclasses.replace(base)) == hash(base)


def test_a_request_is_resubmitted_only_by_the_arguments_that_made_it() -> None:
    table = RequestTable(capacity=16)
    req = _req()
    assert table.repeat_of("w", torch.zeros(64, 64), "Average", 1.0, 2.0) is None  # not cached
    table.remember({0: req, 1: _req()})
    t = torch.zeros(64, 64)
    assert table.repeat_of("w", t, "Average", 1.0, 2.0) is req
    assert table.repeat_of("w", t.t(), "Average", 1.0, 2.0) is req  # strides: not in a request
    for name, tensor, op, pre, post in differing_calls(t):
        assert table.repeat_of(name, tensor, op, pre, post) is None, (name, op, pre, post)
    # Requests no call of one CPU tensor makes are never resubmitted.
    meta = TensorMeta((4,), "torch.float32")
    for odd in (
        Request("g", "allgather", (meta,)),
        _req("two", tensors=(meta, meta)),
        _req("gpu", tensors=(TensorMeta((4,), "torch.float32", "cuda:0"),)),
        _req("bad", error="no"),
    ):
        assert resubmit.of(odd) is None, odd


def _repeats(steps: int) -> dict[str, Any]:
    """Two names in turn, in place and not, counting the requests built after their first
    runs; then a rank changes its call under a cached name."""
    r, size = rt.rank(), rt.size()
    real, built = async_ops.Request, [0]
    got: dict[str, Any] = {"inplace": [], "plain": []}
    try:
        for step in range(steps):
            if step == 1:
                async_ops.Request = counting(built)  # type: ignore[misc]
            t = data(step, r)
            got["inplace"].append((rt.allreduce_(t, name="a", op=rt.Sum) is t, t))
            src = data(step, r)
            out = rt.allreduce(src, name="b", op=rt.Average)
            got["plain"].append((torch.equal(src, data(step, r)), out))
    finally:
        async_ops.Request = real  # type: ignore[misc]
    got["built"] = built[0]
    # Another shape on the last rank only: its call builds a request, the others resubmit the
    # cached one, and the mismatch names both.
    odd = torch.zeros(N + 1 if r == size - 1 else N)
    try:
        rt.allreduce_(odd, name="a", op=rt.Sum)
        got["mismatch"] = ""
    except rt.CollectiveMismatchError as e:
        got["mismatch"] = str(e)
    # A changed dtype under the same name is simply a new request.
    got["double"] = rt.allreduce(torch.full((N,), float(r), dtype=torch.float64), name="a")
    return got


@pytest.mark.parametrize(("size", "fast_lane"), [(2, False), (3, True)])
def test_repeats_build_no_request_and_give_a_new_request_s_results(
    size: int, fast_lane: bool
) -> None:
    steps = 6
    results = spawn.world(size).run(_repeats, steps, timeout=TIMEOUT, fast_lane=fast_lane)
    for got in results:
        assert got["built"] == 0, got["built"]
    for step in range(steps):
        check_spellings(results, step)
    for got in results:
        assert f"float32[{N}]" in got["mismatch"] and f"float32[{N + 1}]" in got["mismatch"]
        assert got["double"].dtype == torch.float64
        assert torch.equal(got["double"], torch.full((N,), (size - 1) / 2, dtype=torch.float64))
