"""Horovod's semantics where ringtrain once differed (issue 12), at 2 and at 4 ranks.

* roots of broadcasts are global ranks, also on process sets, and must belong to the set;
* failed collectives are ``RuntimeError`` (Horovod's ``HorovodInternalError``), argument errors
  ``ValueError``, Adasum ``NotImplementedError``, and a job that catches them goes on;
* ``join()``: the joined ranks add zeros, Average divides by every rank, allgather, broadcast,
  alltoall and reducescatter are refused while a rank has joined, and join returns the last rank;
* handles: ``poll``/``synchronize`` on every kind, and sparse handles are callable; a handle
  synchronized once is released (``synchronize`` again returns None, ``poll`` raises).

Expected values are worked out from Horovod's definitions (horovod/torch/mpi_ops.py and
horovod/common/operations.cc, controller.cc). Each test sends many cases to one spawned job, and
the process sets have members other than rank 0 ({1, 3} and {2, 3} at 4 ranks, {1} at 2).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import ringtrain as rt
import ringtrain.torch as hvd
from ringtrain.collectives import inline
from ringtrain.runtime import queries
from ringtrain.testing import spawn


@pytest.fixture(params=[2, 4], ids=lambda n: f"np{n}")
def world(request: pytest.FixtureRequest) -> spawn.World:
    return spawn.world(request.param)


@pytest.fixture(scope="module", autouse=True)
def _free_the_4_rank_world() -> Iterator[None]:
    yield
    spawn.close(4)  # only this module uses 4 ranks


def _sets(n: int) -> list[list[int]]:
    return [[1, 3], [2, 3]] if n >= 4 else [[1]]


def _with_sets(fn: Callable[[hvd.ProcessSet], Any]) -> dict[str, Any]:
    """``fn(ps)`` on the members of each test set, in turn; results by the set's ranks."""
    sets = [hvd.add_process_set(ranks) for ranks in _sets(hvd.size())]
    out = {str(ps.ranks): fn(ps) for ps in sets if ps.included()}
    hvd.barrier()
    for ps in sets:
        assert hvd.remove_process_set(ps)
    return out


def _raises(call: Callable[[], Any], *types: type[BaseException]) -> BaseException:
    try:
        call()
    except BaseException as e:
        assert isinstance(e, types), (types, e)
        return e
    raise AssertionError(f"no error; expected {types}")


# ---- 1. roots are global ranks -----------------------------------------------------------------


def _set_broadcasts(ps: hvd.ProcessSet) -> None:
    me = hvd.rank()
    executor = ps.communicator.service("controller")._executor
    model = torch.nn.Linear(2, 2)
    for root in ps.ranks:  # global ranks, as Horovod reads root_rank
        small = torch.full((3,), float(me))
        large = torch.full((inline.INLINE_MAX_BYTES // 4 + 1,), float(me))
        before = executor.inline_ops
        got = hvd.broadcast(small, root, process_set=ps)
        assert got.tolist() == [float(root)] * 3, (root, got)
        assert executor.inline_ops == before + 1  # the small one rode in the negotiation
        got = hvd.broadcast(large, root, process_set=ps)
        assert torch.equal(got, torch.full_like(large, root)), root
        assert executor.inline_ops == before + 1  # the large one was a Gloo broadcast
        t = torch.full((2, 2), float(me))
        assert hvd.broadcast_(t, root, process_set=ps) is t and t.eq(root).all()
        h = hvd.broadcast_async(small, root, name="ps.async", process_set=ps)
        assert hvd.synchronize(h).eq(root).all() and small.eq(me).all()
        h = hvd.broadcast_async_(large, root, name="ps.async_", process_set=ps)
        assert hvd.synchronize(h) is large and large.eq(root).all()
        assert hvd.broadcast_object({"from": me}, root, process_set=ps) == {"from": root}
        # autograd: the gradient goes to the root only (its size is issue 12's item 3)
        x = torch.full((2,), float(me), requires_grad=True)
        y = hvd.broadcast(x, root, process_set=ps)
        assert y.tolist() == [float(root)] * 2
        y.sum().backward()
        assert x.grad is not None and bool((x.grad != 0).all()) == (me == root), (root, x.grad)
        # parameters and optimizer state
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(me)
        hvd.broadcast_parameters(model.state_dict(), root, process_set=ps)
        assert all(p.eq(root).all() for p in model.parameters()), root
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (me + 1), momentum=0.9)
        for p in model.parameters():
            p.grad = torch.full_like(p, float(me))
        opt.step()  # momentum buffers = this rank's gradients
        hvd.broadcast_optimizer_state(opt, root, process_set=ps)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * (root + 1))
        for p in model.parameters():
            assert opt.state[p]["momentum_buffer"].eq(root).all(), root
    # A root outside the set: a ValueError on every member (Horovod: its internal error, a
    # RuntimeError; both catch it), naming the set's ranks. Then the set goes on working.
    outside = next(r for r in range(hvd.size()) if r not in ps.ranks)
    x = torch.ones(2, requires_grad=True)
    for call in (
        lambda: hvd.broadcast(torch.ones(3), outside, process_set=ps),
        lambda: hvd.broadcast_(torch.ones(3), outside, process_set=ps),
        lambda: hvd.synchronize(hvd.broadcast_async(torch.ones(3), outside, process_set=ps)),
        lambda: hvd.broadcast(x, outside, process_set=ps),
        lambda: hvd.broadcast_object("x", outside, process_set=ps),
    ):
        e = _raises(call, ValueError)
        assert isinstance(e, hvd.HorovodInternalError) and isinstance(e, RuntimeError)
        assert f"root_rank {outside} is not a member" in str(e) and str(ps.ranks) in str(e), e
    last = numpy.int64(ps.ranks[-1])  # integer-like roots work too
    assert hvd.broadcast(torch.tensor([me]), last, process_set=ps).item() == ps.ranks[-1]
    assert hvd.broadcast_object(me, last, process_set=ps) == ps.ranks[-1]
    if ps.size() > 1:  # members naming different roots: a mismatch naming global ranks
        e = _raises(
            lambda: hvd.broadcast(torch.ones(1), me, name="roots", process_set=ps), RuntimeError
        )
        assert isinstance(e, rt.CollectiveMismatchError), e
        for k in ps.ranks:
            assert f"rank {k}: broadcast(root_rank={k}, float32[1])" in str(e), e


def _process_set_roots() -> None:
    _with_sets(_set_broadcasts)
    for ranks in _sets(hvd.size()):  # a non-member's call: Horovod's internal error, a ValueError
        ps = hvd.add_process_set(ranks)
        if not ps.included():
            call = functools.partial(hvd.broadcast, torch.ones(1), ranks[0], process_set=ps)
            e = _raises(call, ValueError)
            assert isinstance(e, hvd.HorovodInternalError) and "not a member" in str(e), e
        hvd.barrier()
        assert hvd.remove_process_set(ps)


def test_process_set_roots_are_global_ranks(world: spawn.World) -> None:
    world.run(_process_set_roots)


def _issue_case() -> list[float]:
    """Issue 12's report: 4 ranks, set {1, 3}, root_rank=3."""
    ps = hvd.add_process_set([1, 3])
    got = [-1.0]
    if ps.included():
        t = torch.full((4,), 10.0 + hvd.rank())
        got = hvd.broadcast(t, root_rank=3, process_set=ps).unique().tolist()
    hvd.barrier()
    assert hvd.remove_process_set(ps)
    return got


def test_issue_broadcast_on_set_1_3_from_rank_3() -> None:
    assert spawn.world(4).run(_issue_case) == [[-1.0], [13.0], [-1.0], [13.0]]


# ---- 2. the exceptions Horovod users catch -----------------------------------------------------


def _mismatches(ps: Any = None) -> dict[str, str]:
    """Mismatched collectives, each caught as RuntimeError on every rank, then a good one."""
    r = hvd.rank()
    members = ps.ranks if ps is not None else list(range(hvd.size()))
    i = members.index(r)  # odd and even members differ in dtype, op and kind
    big = inline.INLINE_MAX_BYTES // 4 + 1
    cases: dict[str, Callable[[], Any]] = {
        "shape": lambda: hvd.allreduce(torch.ones(3 + r), name="bad.shape", process_set=ps),
        "large shape": lambda: hvd.allreduce(torch.ones(big + r), name="bad.big", process_set=ps),
        "dtype": lambda: hvd.allreduce(
            torch.ones(3, dtype=torch.float32 if i % 2 else torch.float64),
            name="bad.dtype",
            process_set=ps,
        ),
        "op": lambda: hvd.allreduce(
            torch.ones(3), op=hvd.Sum if i % 2 else hvd.Max, name="bad.op", process_set=ps
        ),
        "root": lambda: hvd.broadcast(torch.ones(3), r, name="bad.root", process_set=ps),
        "count": lambda: hvd.grouped_allreduce(
            [torch.ones(2)] * (1 + r), name="bad.count", process_set=ps
        ),
        "scale": lambda: hvd.allreduce(
            torch.ones(2), prescale_factor=1.0 + r, name="bad.scale", process_set=ps
        ),
        "kind": lambda: (hvd.allreduce if i % 2 else hvd.allgather)(
            torch.ones(2), name="bad.kind", process_set=ps
        ),
    }
    messages = {}
    for what, call in cases.items():
        try:  # what a Horovod script writes
            call()
        except RuntimeError as e:
            assert isinstance(e, rt.CollectiveMismatchError) and isinstance(
                e, hvd.HorovodInternalError
            )
            messages[what] = str(e)
        else:
            raise AssertionError(f"{what}: no error")
        good = hvd.allreduce(
            torch.ones(2) * (r + 1), op=hvd.Sum, name=f"good.{what}", process_set=ps
        )
        assert good.tolist() == [float(sum(k + 1 for k in members))] * 2
    return messages


def _exceptions() -> dict[str, Any]:
    n = hvd.size()
    out: dict[str, Any] = {"world": _mismatches()}
    # Adasum: NotImplementedError (a RuntimeError) as Horovod raises where it lacks Adasum
    for call in (
        lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum),
        lambda: hvd.allreduce_async_(torch.ones(2), op=hvd.Adasum),
        lambda: hvd.grouped_allreduce([torch.ones(2)], op=hvd.Adasum),
        lambda: hvd.allreduce(torch.ones(2), op=2),  # Horovod's number for Adasum
    ):
        e = _raises(call, NotImplementedError)
        assert isinstance(e, RuntimeError) and "Adasum is not supported" in str(e)
    # Argument errors Horovod raises as ValueError stay ValueError
    _raises(lambda: hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum), ValueError)
    _raises(lambda: hvd.allreduce(torch.ones(1), op="median"), ValueError)
    _raises(lambda: hvd.allreduce(torch.ones(1), op=7), ValueError)  # no Horovod op is 7
    _raises(lambda: hvd.allreduce(torch.ones(1), op=True), ValueError)  # a flag, not Sum
    _raises(lambda: hvd.synchronize(3), ValueError)
    _raises(lambda: hvd.poll("h"), ValueError)
    _raises(lambda: hvd.sparse_allreduce_async(torch.ones(2), "s", hvd.Sum), ValueError)
    # ...and those Horovod finds in its controller (a RuntimeError there) are both
    e = _raises(lambda: hvd.alltoall(torch.ones(n + 1), splits=[1] * (n + 1)), ValueError)
    assert isinstance(e, RuntimeError) and "expected one per rank" in str(e)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n
    out["sets"] = _with_sets(lambda ps: _mismatches(ps) if ps.size() > 1 else {})
    return out


def test_mismatches_are_runtime_errors_a_script_can_catch(world: spawn.World) -> None:
    n = world.size
    results = world.run(_exceptions)
    for rank, result in enumerate(results):
        msgs = result["world"]
        # every rank's submission is named, by global rank
        for k in range(n):
            assert f"rank {k}: allreduce(op=Average, float32[{3 + k}])" in msgs["shape"], msgs
            assert f"rank {k}: broadcast(root_rank={k}, float32[3])" in msgs["root"], msgs
        assert "(dtype differs)" in msgs["dtype"] and "float64[3]" in msgs["dtype"]
        assert "(reduce op differs)" in msgs["op"] and "op=Max" in msgs["op"]
        assert "(number of tensors differs)" in msgs["count"]
        assert "(scale factor differs)" in msgs["scale"] and "prescale_factor=2" in msgs["scale"]
        assert "(operation differs)" in msgs["kind"] and "allgather(" in msgs["kind"]
        assert "(shape differs)" in msgs["large shape"]
        for ranks, set_msgs in result["sets"].items():
            members = json.loads(ranks)
            assert rank in members
            if len(members) > 1:
                for k in members:
                    assert f"rank {k}: allreduce(op=Average, float32[{3 + k}])" in set_msgs["shape"]
                    assert f"rank {k}: broadcast(root_rank={k}, float32[3])" in set_msgs["root"]


def _adasum_of_one() -> dict[str, Any]:
    t = torch.tensor([1.0, -2.0])
    out: dict[str, Any] = {}
    if hvd.size() == 1:  # Horovod's Adasum of the one rank's tensor: that tensor (scaled)
        out["world"] = [
            hvd.allreduce(t, op=hvd.Adasum).tolist(),
            hvd.allreduce_(t.clone(), op=2).tolist(),  # Horovod's number for Adasum
            hvd.grouped_allreduce([t], op=hvd.Adasum, postscale_factor=2.0)[0].tolist(),
            hvd.synchronize(hvd.allreduce_async(t, op=hvd.Adasum)).tolist(),
        ]
    if hvd.size() == 1:
        return out  # [0] is the global set's ranks: add_process_set refuses them, as Horovod's
    ps = hvd.add_process_set([hvd.size() - 1])
    if ps.included():  # a set of one rank is not the global set: NotImplementedError there
        e = _raises(lambda: hvd.allreduce(t, op=hvd.Adasum, process_set=ps), NotImplementedError)
        out["set"] = str(e)
    assert hvd.remove_process_set(ps)
    return out


@pytest.mark.parametrize("n", [1, 2])
def test_adasum_of_one_rank_as_horovod(n: int) -> None:
    # horovod/torch/mpi_ops.py _allreduce_async: Adasum raises NotImplementedError on a
    # non-global process set; on the global set of one rank its C++ Adasum returns the tensor.
    results = spawn.world(n).run(_adasum_of_one)
    if n == 1:
        assert results[0]["world"] == [[1.0, -2.0], [1.0, -2.0], [2.0, -4.0], [1.0, -2.0]]
    else:
        assert "Adasum runs only on the global process set" in results[-1]["set"]


def test_before_init_queries_raise_value_error_as_horovod() -> None:
    with pytest.raises(ValueError, match=r"init\(\)"):
        hvd.size()
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(rt.CollectiveMismatchError, hvd.HorovodInternalError)
    # Horovod's basics.py: ValueError where its MPI is not enabled, as ringtrain's never is
    assert not hvd.mpi_enabled()
    with pytest.raises(ValueError, match="MPI is not enabled"):
        hvd.mpi_threads_supported()


def test_nccl_built_is_horovods_version_code() -> None:
    # Horovod's basics.py returns NCCL_VERSION_CODE, or 0; its tests compare it with 2700
    built = hvd.nccl_built()
    assert type(built) is int
    if not torch.distributed.is_nccl_available():
        assert built == 0
    else:
        assert built == queries.nccl_version_code(torch.cuda.nccl.version())
    # nccl.h's NCCL_VERSION: a digit less for the minor version before 2.9
    assert queries.nccl_version_code((2, 7, 8)) == 2708
    assert queries.nccl_version_code((2, 8, 4)) == 2804
    assert queries.nccl_version_code((2, 9, 6)) == 20906
    assert queries.nccl_version_code((2, 21, 5)) == 22105
    assert queries.nccl_version_code((3, 0, 1)) == 30001


def _average_flag() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hvd.allreduce(torch.ones(1), average=False).item() == hvd.size()
    return [str(w.message) for w in caught if w.category is DeprecationWarning]


def test_the_average_flag_warns_as_horovod(world2: spawn.World) -> None:
    for messages in world2.run(_average_flag):
        assert messages == [
            "Parameter `average` has been replaced with `op` and will be removed in v1.0"
        ]


# ---- 4. join -----------------------------------------------------------------------------------


def _refused_while_joined(n: int, step: int) -> dict[str, Callable[[], Any]]:
    """What Horovod's controller refuses while a rank has joined (and Min, which would take
    the joined ranks' zeros for data)."""
    return {
        "allgather": lambda: hvd.allgather(torch.ones(1), name=f"ag.{step}"),
        "broadcast": lambda: hvd.broadcast(torch.ones(1), n - 1, name=f"bc.{step}"),
        "alltoall": lambda: hvd.alltoall(torch.ones(n), name=f"a2a.{step}"),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(n, 2), name=f"rs.{step}"),
        "broadcast_object": lambda: hvd.broadcast_object(1, n - 1, name=f"bo.{step}"),
        "min": lambda: hvd.allreduce(torch.ones(1), op=hvd.Min, name=f"min.{step}"),
    }


def _join() -> int:
    r, n = hvd.rank(), hvd.size()
    big = inline.INLINE_MAX_BYTES // 4 + 1
    for step in range(r + 1):  # rank r has r + 1 batches; ranks below `step` have joined
        active = range(step, n)

        def value(k: int, step: int = step) -> float:
            return float((k + 1) * (step + 1))

        # Horovod: joined ranks contribute zeros, Average divides by size(), not by the active
        for length, tag in ((3, "small"), (big, "big")):
            mine = torch.full((length,), value(r))
            avg = hvd.allreduce(mine, name=f"avg.{tag}.{step}")
            torch.testing.assert_close(avg, torch.full_like(mine, sum(map(value, active)) / n))
            total = hvd.allreduce(mine, op=hvd.Sum, name=f"sum.{tag}.{step}")
            torch.testing.assert_close(total, torch.full_like(mine, sum(map(value, active))))
        outs = hvd.grouped_allreduce([torch.ones(2) * value(r)] * 2, name=f"grouped.{step}")
        torch.testing.assert_close(outs[1], torch.ones(2) * sum(map(value, active)) / n)
        if step == 0:
            continue
        refused = _refused_while_joined(n, step)
        for what, call in refused.items():
            e = _raises(call, RuntimeError)
            assert isinstance(e, hvd.HorovodInternalError), (what, e)
            assert f"ranks {list(range(step))} have joined" in str(e), (what, e)
        hvd.barrier()  # barriers still run
    return hvd.join()


def test_join_as_horovod(world: spawn.World) -> None:
    # the rank with the most batches joins last, and join returns it on every rank
    assert world.run(_join) == [world.size - 1] * world.size


# ---- 6. handles --------------------------------------------------------------------------------


def _rank_dense(k: int) -> torch.Tensor:
    d = torch.zeros(4, 2)
    d[0] = 1.0
    d[k % 4] += k + 1
    return d


def _handles(ps: Any = None) -> None:
    r = hvd.rank()
    members = ps.ranks if ps is not None else list(range(hvd.size()))
    n = len(members)
    total = float(sum(k + 1 for k in members))
    mine = torch.ones(n, 2) * (r + 1)
    starts: dict[str, tuple[Callable[[], rt.Handle], Callable[[Any], bool]]] = {
        "allreduce_async": (
            lambda: hvd.allreduce_async(mine, op=hvd.Sum, process_set=ps),
            lambda out: bool(out.eq(total).all()),
        ),
        "allreduce_async_": (
            lambda: hvd.allreduce_async_(mine.clone(), op=hvd.Sum, process_set=ps),
            lambda out: bool(out.eq(total).all()),
        ),
        "grouped_allreduce_async": (
            lambda: hvd.grouped_allreduce_async([mine, mine], op=hvd.Sum, process_set=ps),
            lambda out: all(o.eq(total).all() for o in out),
        ),
        "grouped_allreduce_async_": (
            lambda: hvd.grouped_allreduce_async_([mine.clone()], op=hvd.Sum, process_set=ps),
            lambda out: bool(out[0].eq(total).all()),
        ),
        "allgather_async": (
            lambda: hvd.allgather_async(torch.tensor([r]), process_set=ps),
            lambda out: out.tolist() == members,
        ),
        "grouped_allgather_async": (
            lambda: hvd.grouped_allgather_async([torch.tensor([r])], process_set=ps),
            lambda out: out[0].tolist() == members,
        ),
        "broadcast_async": (
            lambda: hvd.broadcast_async(torch.tensor([r]), members[-1], process_set=ps),
            lambda out: out.tolist() == [members[-1]],
        ),
        "broadcast_async_": (
            lambda: hvd.broadcast_async_(torch.tensor([r]), members[-1], process_set=ps),
            lambda out: out.tolist() == [members[-1]],
        ),
        "reducescatter_async": (
            lambda: hvd.reducescatter_async(mine, op=hvd.Sum, process_set=ps),
            lambda out: out.shape == (1, 2) and bool(out.eq(total).all()),
        ),
        "grouped_reducescatter_async": (
            lambda: hvd.grouped_reducescatter_async([mine], op=hvd.Sum, process_set=ps),
            lambda out: bool(out[0].eq(total).all()),
        ),
        "alltoall_async": (  # (output, received splits), with or without splits, as Horovod
            lambda: hvd.alltoall_async(torch.tensor(members) * 0 + r, process_set=ps),
            lambda out: out[0].tolist() == members and out[1].tolist() == [1] * n,
        ),
        "alltoall_async splits": (
            lambda: hvd.alltoall_async(torch.tensor([r] * n), [1] * n, process_set=ps),
            lambda out: out[0].tolist() == members and out[1].tolist() == [1] * n,
        ),
        "sparse_allreduce_async": (
            lambda: hvd.sparse_allreduce_async(
                _rank_dense(r).to_sparse(), "sparse", hvd.Average, process_set=ps
            ),
            lambda out: torch.allclose(
                out.to_dense(), torch.stack([_rank_dense(k) for k in members]).mean(0)
            ),
        ),
    }
    for kind, (start, check) in starts.items():
        h = start()
        assert isinstance(hvd.poll(h), bool), kind
        out = h() if kind == "sparse_allreduce_async" else hvd.synchronize(h)  # as Horovod's users
        assert check(out), (kind, out)
        assert h() is out, kind  # calling it again: the same result
        if kind != "sparse_allreduce_async":  # synchronized: released, as Horovod's handles
            assert hvd.synchronize(h) is None, kind
    if n > 1:  # a failed op: done, and every call raises its error
        h = hvd.allreduce_async(torch.ones(1 + r), name="h.bad", process_set=ps)
        while not hvd.poll(h):
            pass
        _raises(h, rt.CollectiveMismatchError)
        _raises(lambda: hvd.synchronize(h), rt.CollectiveMismatchError)
        _raises(h, rt.CollectiveMismatchError)


def _all_handles() -> None:
    _handles()
    _with_sets(_handles)


def test_handles_poll_synchronize_and_call(world: spawn.World) -> None:
    world.run(_all_handles)


@pytest.mark.parametrize("wait", ["synchronize", "poll"])
def test_something_that_is_not_a_handle_is_a_clear_error(wait: str) -> None:
    # Horovod's synchronize returns None for what it does not know: a mistake such as
    # synchronize(tensor) would pass unseen (docs/horovod.md, "Different on purpose").
    with pytest.raises(ValueError, match=f"{wait} expects a handle from an \\*_async call"):
        getattr(rt, wait)(torch.ones(1))


def test_a_horovod_script_catches_the_mismatch_on_every_rank(tmp_path: Path) -> None:
    source = (Path(__file__).parent / "horovod_catch.py").read_text()
    script = tmp_path / "catch.py"
    script.write_text(
        source.replace("import horovod.torch as hvd", "import ringtrain.torch as hvd")
    )
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        assert f"[{r}] caught CollectiveMismatchError internal=True" in proc.stdout, proc.stdout
        assert f"[{r}] after [2.0, 2.0]" in proc.stdout, proc.stdout
    assert "[1] set broadcast 1" in proc.stdout, proc.stdout


def _synchronize_twice() -> dict[str, Any]:
    h = hvd.allreduce_async(torch.ones(2), op=hvd.Sum, name="twice")
    out = hvd.synchronize(h)
    again = hvd.synchronize(h)
    polled = _raises(lambda: hvd.poll(h), ValueError)
    bad = hvd.allreduce_async(torch.ones(1 + hvd.rank()), name="twice.bad")
    _raises(lambda: hvd.synchronize(bad), RuntimeError)
    return {
        "out": out.tolist(),
        "again": again,
        "bad again": hvd.synchronize(bad),
        "poll": str(polled),
        "called": h().tolist(),  # ringtrain's own: a handle called returns its result
    }


def test_a_second_synchronize_returns_none_as_horovod(world2: spawn.World) -> None:
    # horovod/torch/mpi_ops.py synchronize(): `if handle not in _handle_map: return`, and the
    # first call pops the handle, with its result or its error; poll() of it then raises
    # ValueError (horovod/torch/handle_manager.cc: "was not created or has been cleared").
    for res in world2.run(_synchronize_twice):
        assert res["out"] == [2.0, 2.0] and res["called"] == [2.0, 2.0], res
        assert res["again"] is None and res["bad again"] is None, res
        assert res["poll"].startswith("poll: the handle of 'twice' was synchronized already"), res


@pytest.mark.parametrize("kind", ["named_parameters", "parameters", "tuple"])
def test_broadcast_parameters_refuses_what_horovods_refuses(kind: str) -> None:
    # horovod/torch/functions.py broadcast_parameters: a dict or a list, else
    # ValueError('invalid params of type ...'), before any collective (so no init here).
    model = torch.nn.Linear(2, 1)
    params = {
        "named_parameters": model.named_parameters(),
        "parameters": model.parameters(),
        "tuple": tuple(model.parameters()),
    }[kind]
    with pytest.raises(ValueError) as e:
        hvd.broadcast_parameters(params, root_rank=0)
    said = str(e.value)
    assert said.startswith("broadcast_parameters expects model.state_dict()"), said
    assert f"got {type(params).__name__}" in said and "HINT: pass list(model." in said, said


def _zero_d_allgathers() -> dict[str, str]:
    s = torch.tensor(float(hvd.rank()))
    said = {
        "allgather": str(_raises(lambda: hvd.allgather(s), RuntimeError)),
        "async": str(_raises(lambda: hvd.synchronize(hvd.allgather_async(s)), RuntimeError)),
        "grouped": str(_raises(lambda: hvd.grouped_allgather([s.reshape(1), s]), ValueError)),
    }
    assert hvd.allgather(s.reshape(1)).tolist() == [0.0, 1.0]  # the job goes on
    return said


def test_allgather_of_a_0d_tensor_fails_as_horovods(world2: spawn.World) -> None:
    # horovod/common/controller.cc ConstructResponse: "Rank zero tried to ALLGATHER a rank-zero
    # tensor.", an error response, so synchronize raises HorovodInternalError on every rank.
    for said in world2.run(_zero_d_allgathers):
        for kind, msg in said.items():
            assert "allgather needs a tensor with at least one dimension" in msg, (kind, msg)
            assert "got a 0-d tensor" in msg and "HINT: t.reshape(1)" in msg, (kind, msg)


def _non_contiguous() -> dict[str, Any]:
    r, n = hvd.rank(), hvd.size()
    odd = torch.arange(2.0 * n).reshape(2, n).t()  # (n, 2), strides (1, n): not contiguous
    good = torch.ones(n, 2)
    calls: dict[str, Callable[[], Any]] = {
        "allreduce": lambda: hvd.allreduce(odd, name="nc.ar"),
        "allreduce named again": lambda: hvd.allreduce(odd, name="nc.ar.again"),
        "allreduce_": lambda: hvd.allreduce_(odd.clone().t().contiguous().t()),
        "allreduce_async": lambda: hvd.synchronize(hvd.allreduce_async(odd)),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([good, odd]),
        "allgather": lambda: hvd.allgather(odd),
        "grouped_allgather": lambda: hvd.grouped_allgather([odd]),
        "broadcast": lambda: hvd.broadcast(odd, 0),
        "broadcast_": lambda: hvd.broadcast_(odd.clone().t().contiguous().t(), 0),
        "alltoall": lambda: hvd.alltoall(odd),
        "reducescatter": lambda: hvd.reducescatter(odd),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter([odd]),
    }
    hvd.allreduce(good, name="nc.ar.again")  # a named op seen before takes a shorter path
    said = {kind: str(_raises(call, ValueError)) for kind, call in calls.items()}
    # broadcast_parameters (and the optimizer's state) take non-contiguous tensors still: a
    # channels_last model's weights are not contiguous.
    weight = torch.nn.Parameter(torch.full((2, 3), float(r)).t())
    hvd.broadcast_parameters([weight], root_rank=1)
    said["parameters"] = weight.tolist()
    return said


def test_non_contiguous_tensors_are_refused_as_horovod(world2: spawn.World) -> None:
    # horovod/torch/mpi_ops.py _check_function, called by every collective's _async:
    # ValueError('Tensor is required to be contiguous.').
    for said in world2.run(_non_contiguous):
        assert said.pop("parameters") == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
        for kind, msg in said.items():
            assert "needs contiguous tensors" in msg, (kind, msg)
            assert "HINT: pass t.contiguous()" in msg, (kind, msg)
