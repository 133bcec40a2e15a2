"""The fast lane (collectives/lane.py): repeated allreduces skip the negotiation round, with the
same results, name matching and mismatch reports as negotiated ones; at 2 and 3 ranks."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ringtrain as rt
from ringtrain.collectives import lane
from ringtrain.collectives.ops import controller_of
from ringtrain.testing import spawn

# Generous: the first call also waits for the ranks to start (importing torch on a busy machine).
TIMEOUT = 150
N = 4096  # 16 KiB of float32: above what travels inline, so the lane may take it


@pytest.fixture(params=[2, 3], ids=lambda n: f"np{n}")
def world(request: pytest.FixtureRequest) -> spawn.World:
    return spawn.world(request.param)


def _data(step: int, rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(N, generator=g) * 100
    return x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to the order of the sum (3 ranks: Gloo's ring order, not rank order)."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def _slots(process_set: rt.ProcessSet | None = None) -> tuple[int, int]:
    return controller_of(process_set).lane_slots


def _repeat(steps: int) -> tuple[list[torch.Tensor], tuple[int, int]]:
    """The same named allreduces, step after step, in every variant the lane takes."""
    r = rt.rank()
    out: list[torch.Tensor] = []
    for step in range(steps):
        out.append(rt.allreduce(_data(step, r), name="avg", op=rt.Average))
        t = _data(step, r, torch.float64)
        assert rt.allreduce_(t, name="sum64", op=rt.Sum) is t
        out.append(t)
        h = rt.allreduce_async(_data(step, r, torch.int32), name="int", op=rt.Average)
        out.append(rt.synchronize(h))  # integers are negotiated: they cannot ride the lane
        h = rt.allreduce_async_(_data(step, r, torch.float16), name="half", op=rt.Sum)
        out.append(rt.synchronize(h))
    return out, _slots()


def _patient(release_s: float, fn_name: str, *args: object) -> object:
    """Run ``fn_name(*args)`` with the lane releasing a waiting claim only after ``release_s``:
    on a busy machine a rank can be descheduled past the default second, and a test that counts
    lane slots must not depend on that (results never do)."""
    saved = lane.RELEASE_S
    lane.RELEASE_S = release_s
    try:
        return globals()[fn_name](*args)
    finally:
        lane.RELEASE_S = saved


def _run(world: spawn.World, fn: Any, *args: Any, release_s: float = 60.0, **kw: Any) -> Any:
    """world.run with the lane on (it is opt-in) and a patient release, unless a test says."""
    if "env" not in kw:
        kw.setdefault("fast_lane", True)
    return world.run(_patient, release_s, fn.__name__, *args, timeout=TIMEOUT, **kw)


def test_repeated_allreduces_match_the_negotiated_path_bitwise(world: spawn.World) -> None:
    fast = _run(world, _repeat, 6)
    slow = _run(world, _repeat, 6, fast_lane=False)
    n = world.size
    for r in range(n):
        for a, b in zip(fast[r][0], slow[r][0]):
            assert torch.equal(a, b), (r, a.dtype)
        for a, b in zip(fast[r][0], fast[0][0]):
            assert torch.equal(a, b)  # every rank holds the same bits
        assert slow[r][1] == (0, 0)
    # four names alternate, so the lane keeps the last one it switched to: it rode some
    valid = [fast[r][1][0] for r in range(n)]
    assert valid == [valid[0]] * n and valid[0] >= 3, fast[0][1]
    expected = sum(_data(5, r) for r in range(n)) / n
    _close(fast[0][0][-4], expected)


def _one_name(steps: int) -> tuple[list[torch.Tensor], tuple[int, int]]:
    r = rt.rank()
    got = [rt.allreduce(_data(s, r), name="loss", op=rt.Sum) for s in range(steps)]
    return got, _slots()


def test_one_repeated_name_rides_the_lane_from_its_second_run(world: spawn.World) -> None:
    results = _run(world, _one_name, 8)
    for got, (valid, invalid) in results:
        # The first run is negotiated (and reserves the lane); the rest ride it.
        assert valid >= 6 and invalid == 0, (valid, invalid)
        for s, t in enumerate(got):
            _close(t, sum(_data(s, r) for r in range(world.size)))


def _switch() -> tuple[tuple[int, int], tuple[int, int]]:
    r = rt.rank()
    for s in range(5):
        rt.allreduce(_data(s, r), name="first", op=rt.Sum)
    after_first = _slots()
    # The switch takes a few rounds (misses, the dummy slot, its flags, the reopening), one step
    # each, and a descheduled rank can add a round: 12 steps leave room for that.
    for s in range(12):
        got = rt.allreduce(_data(s, r)[: N // 2], name="second", op=rt.Sum)
        _close(got, sum(_data(s, k)[: N // 2] for k in range(rt.size())))
    return after_first, _slots()


def test_the_lane_follows_a_new_name(world: spawn.World) -> None:
    for first, second in _run(world, _switch):
        assert first[0] >= 3
        # "second" misses the reservation a few times, the lane gives it up (one slot no rank
        # used), reopens for "second", which then rides it
        assert second[0] - first[0] >= 3, (first, second)


def _reshaped() -> tuple[int, int]:
    r = rt.rank()
    for s in range(4):
        rt.allreduce(_data(s, r), name="x", op=rt.Sum)
    # The same name, another shape, on every rank: negotiated, then the lane (after a switch of
    # a few rounds, as in _switch).
    for s in range(12):
        got = rt.allreduce(_data(s, r).reshape(64, -1), name="x", op=rt.Sum)
        assert got.shape == (64, N // 64)
        expected = sum(_data(s, k) for k in range(rt.size())).reshape(64, -1)
        _close(got, expected)
    return _slots()


def test_a_name_reused_with_another_shape(world: spawn.World) -> None:
    for valid, _ in _run(world, _reshaped):
        assert valid >= 6  # 3 of the first shape, at least 3 of the second


def _mismatch_on_the_lane(kind: str) -> str:
    r = rt.rank()
    for s in range(4):
        rt.allreduce(_data(s, r), name="m", op=rt.Sum)
    assert _slots()[0] >= 2
    # The last rank submits "m" differently: the others claim the lane with the reserved
    # request, and must still get the mismatch error that lists every rank's submission.
    t = _data(9, r)
    op = rt.Sum
    if r == rt.size() - 1:
        if kind == "shape":
            t = t[:-1]
        elif kind == "dtype":
            t = t.double()
        else:
            op = rt.Max
    try:
        rt.allreduce(t, name="m", op=op)
    except rt.CollectiveMismatchError as e:
        message = str(e)
    else:
        raise AssertionError("the mismatch went unnoticed")
    # The controller and the lane live on: the name works again, and rides the lane again.
    before = _slots()[0]
    for s in range(4):
        got = rt.allreduce(_data(s, r), name="m", op=rt.Sum)
        _close(got, sum(_data(s, k) for k in range(rt.size())))
    assert _slots()[0] > before
    return message


@pytest.mark.parametrize("kind", ["shape", "dtype", "op"])
def test_mismatch_on_a_cached_name_is_reported_with_every_rank(
    world: spawn.World, kind: str
) -> None:
    messages = _run(world, _mismatch_on_the_lane, kind)
    n = world.size
    last = n - 1
    assert len(set(messages)) == 1, messages  # one message, on every rank
    msg = messages[0]
    assert "ranks submitted collective 'm' with different arguments" in msg, msg
    others = "rank 0" if n == 2 else f"ranks 0-{last - 1}"
    assert f"  {others}: allreduce(op=Sum, float32[{N}])" in msg, msg
    assert f"  rank {last}: allreduce(" in msg, msg


def _out_of_order() -> list[torch.Tensor]:
    r = rt.rank()
    for s in range(3):
        rt.allreduce(_data(s, r), name="a", op=rt.Sum)
    names = ["a", "b", "c"]
    order = names if r % 2 == 0 else names[::-1]
    handles = {
        nm: rt.allreduce_async(_data(7, r) + i, name=nm, op=rt.Sum) for i, nm in enumerate(order)
    }
    return [rt.synchronize(handles[nm]) for nm in names]


def test_ranks_submitting_in_different_orders(world: spawn.World) -> None:
    results = _run(world, _out_of_order)
    n = world.size
    for r in range(n):
        for i, nm in enumerate(["a", "b", "c"]):
            pos = [["a", "b", "c"] if k % 2 == 0 else ["c", "b", "a"] for k in range(n)]
            expected = sum(_data(7, k) + pos[k].index(nm) for k in range(n))
            _close(results[r][i], expected)


def _late(delay: float) -> tuple[int, int]:
    r = rt.rank()
    for s in range(3):
        rt.allreduce(_data(s, r), name="late", op=rt.Sum)
    if r == rt.size() - 1:
        time.sleep(delay)  # the others wait in the lane meanwhile
    got = rt.allreduce(_data(5, r), name="late", op=rt.Sum)
    _close(got, sum(_data(5, k) for k in range(rt.size())))
    return _slots()


def test_a_late_rank_joins_the_slot(world: spawn.World) -> None:
    # Late enough that the waiting ranks wake the controllers (lane.NUDGE_S), within RELEASE_S.
    for valid, invalid in _run(world, _late, 0.5):
        assert invalid == 0 and valid >= 2


def test_a_rank_away_longer_than_the_release_time(world: spawn.World) -> None:
    # The others' claim is released (a dummy from the absent rank) and the op is negotiated.
    for valid, invalid in _run(world, _late, 2.0, release_s=lane.RELEASE_S):
        assert invalid == 1 and valid >= 1


def _nan_first() -> tuple[list[torch.Tensor], tuple[int, int], int]:
    r = rt.rank()
    got = []
    for s in range(4):
        t = _data(s, r)
        if s >= 2:
            t[0] = float("nan")  # as a dummy marks its slot: the flags tell the two apart
        got.append(rt.allreduce(t, name="nan", op=rt.Sum))
    return got, _slots(), controller_of(None)._fast.lane.flag_rounds  # type: ignore[union-attr]


def test_nan_in_the_first_value_is_told_from_a_dummy(world: spawn.World) -> None:
    for got, (valid, invalid), flag_rounds in _run(world, _nan_first):
        assert invalid == 0 and valid == 3 and flag_rounds == 2
        for s, t in enumerate(got):
            expected = sum(_data(s, k) for k in range(world.size))
            if s >= 2:
                assert torch.isnan(t[0])
                t, expected = t[1:], expected[1:]
            _close(t, expected)


def _busy_elsewhere() -> tuple[int, int]:
    """The last rank runs another collective first, which waits for the others: its controller
    releases the slot at once, so neither waits out the release time."""
    r, n = rt.rank(), rt.size()
    for s in range(3):
        rt.allreduce(_data(s, r), name="busy", op=rt.Sum)
    if r == n - 1:
        h = rt.broadcast_async(torch.ones(N), 0, name="other")
    t0 = time.monotonic()
    got = rt.allreduce(_data(5, r), name="busy", op=rt.Sum)
    _close(got, sum(_data(5, k) for k in range(n)))
    if r != n - 1:
        rt.broadcast(torch.ones(N), 0, name="other")
    else:
        rt.synchronize(h)
    assert time.monotonic() - t0 < 30
    return _slots()


def test_a_rank_busy_with_another_collective(world: spawn.World) -> None:
    for _, invalid in _run(world, _busy_elsewhere):
        assert invalid <= 1


def _join() -> int:
    r, n = rt.rank(), rt.size()
    for step in range(3 + r):  # the last rank has the most batches; the others join early
        active = [k for k in range(n) if step < 3 + k]
        got = rt.allreduce(torch.full((N,), float(r + 1)), name="j", op=rt.Sum)
        _close(got, torch.full((N,), float(sum(k + 1 for k in active))))
    return rt.join()


def test_join_while_the_lane_is_open(world: spawn.World) -> None:
    assert _run(world, _join) == [world.size - 1] * world.size


def _process_sets() -> tuple[tuple[int, int], tuple[int, int]]:
    r, n = rt.rank(), rt.size()
    ps = rt.add_process_set([0, 1])
    try:
        for s in range(5):
            got = rt.allreduce(_data(s, r), name="w", op=rt.Sum)
            _close(got, sum(_data(s, k) for k in range(n)))
            if r in (0, 1):  # the same name on the set: its own controller, its own lane
                got = rt.allreduce(_data(s, r), name="w", op=rt.Sum, process_set=ps)
                _close(got, _data(s, 0) + _data(s, 1))
        on_set = _slots(ps) if r in (0, 1) else (0, 0)
        return _slots(), on_set
    finally:
        rt.remove_process_set(ps)


def test_process_sets_have_lanes_of_their_own(world: spawn.World) -> None:
    if world.size < 3:  # as Horovod's, add_process_set refuses the whole world's ranks
        pytest.skip("a set of 2 ranks other than the global one needs a world of 3")
    for r, (world_slots, set_slots) in enumerate(_run(world, _process_sets)):
        assert world_slots[0] >= 3
        if r in (0, 1):
            assert set_slots[0] >= 3


def test_the_lane_can_be_turned_off(world: spawn.World) -> None:
    for _got, slots in _run(world, _one_name, 3, env={"RINGTRAIN_FAST_LANE": "0"}):
        assert slots == (0, 0)


def _abandoned_claim() -> tuple[int, int]:
    """Rank 0 claims a slot and never waits for it; the others never submit the name; then
    every rank shuts down (the harness calls ringtrain.shutdown()): nobody may hang."""
    r = rt.rank()
    for s in range(3):
        rt.allreduce(_data(s, r), name="gone", op=rt.Sum)
    if r == 0:
        rt.allreduce_async(_data(5, r), name="gone", op=rt.Sum)
    return _slots()


def test_shutdown_with_a_claim_nobody_matched(world: spawn.World) -> None:
    t0 = time.monotonic()
    _run(world, _abandoned_claim)
    assert time.monotonic() - t0 < 60
    # The ranks are fine afterwards: the next job in the same processes runs.
    for _got, (valid, invalid) in _run(world, _one_name, 3):
        assert invalid == 0 and valid >= 1


def _traced(base: str) -> list[str]:
    import json

    from ringtrain.diagnostics import timeline

    rt.start_timeline(base)
    path = timeline.rank_path(base, rt.rank())
    for s in range(4):
        rt.allreduce(_data(s, rt.rank()), name="traced", op=rt.Sum)
    rt.stop_timeline()
    with open(path) as f:
        return [e["name"] for e in json.load(f)["traceEvents"]]


def test_the_timeline_shows_lane_ops(world: spawn.World, tmp_path: Path) -> None:
    for names in _run(world, _traced, str(tmp_path / "trace.json")):
        assert names.count("ALLREDUCE (lane)") >= 2, names
        assert "NEGOTIATE" in names  # the first run, which reserved the lane
