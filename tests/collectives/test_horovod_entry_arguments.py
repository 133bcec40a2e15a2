"""Horovod's entry points called with Horovod's arguments: ``init(comm, process_sets)``,
``add_process_set``/``remove_process_set``/``ProcessSet`` by their keyword names, and
``broadcast_optimizer_state(optimizer, root_rank, model)`` with sparse embeddings
(horovod/common/basics.py, process_sets.py, horovod/torch/functions.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch

import ringtrain.torch as hvd
from _mpirun import mpirun_env
from ringtrain.errors import CollectiveArgumentError, ConfigError
from ringtrain.testing.spawn import World


class _Comm:
    """What ringtrain looks at in an mpi4py communicator."""

    def __init__(self, size: int, reversed_ranks: bool = False) -> None:
        self._size = size
        self._reversed = reversed_ranks

    def Get_size(self) -> int:
        return self._size

    def Get_rank(self) -> int:
        return self._size - 1 - hvd.rank() if self._reversed else hvd.rank()


def _refused(call: Any, kind: type[Exception]) -> str:
    with pytest.raises(kind) as e:
        call()
    return str(e.value)


def _init_arguments() -> list[str]:
    said = []
    n = hvd.size()
    for comm in (list(range(n)), _Comm(n)):  # the whole world, as a list or a communicator
        hvd.shutdown()
        hvd.init(comm)
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n
    # A part of it, or all of it numbered otherwise: refused on every rank, then init() again.
    for comm in ([0], _Comm(n + 1), _Comm(n, reversed_ranks=True)):
        hvd.shutdown()
        said.append(_refused(lambda c=comm: hvd.init(comm=c), ConfigError).splitlines()[0])
    said.append(_refused(lambda: hvd.init(comm="all"), ConfigError).splitlines()[0])
    said.append(_refused(lambda: hvd.init(process_sets="static"), ConfigError).splitlines()[0])
    hvd.init(process_sets="DYNAMIC")
    ps = hvd.add_process_set(process_set=hvd.ProcessSet(ranks_or_comm=[n - 1]))
    out = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=ps) if ps.included() else None
    assert out is None or out.item() == 1
    assert hvd.remove_process_set(process_set=ps)
    said.append(_refused(lambda: hvd.ProcessSet(_Comm(n)), CollectiveArgumentError).split("\n")[0])
    return said


def test_init_takes_horovods_comm_and_dynamic_process_sets(world2: World) -> None:
    said = world2.run(_init_arguments)
    assert said[0] == said[1]  # every rank refuses alike
    subset, wider, renumbered, not_comm, static, mpi_set = said[0]
    assert "init(comm=[0]): ringtrain's world is every rank its launcher started" in subset
    assert "the communicator has 3 ranks, the job 2" in wider
    assert "numbers the ranks differently from the job (job rank 0 is its 1, 1 is its 0)" in (
        renumbered
    )
    assert "comm is a list of ranks or an MPI communicator" in not_comm
    assert 'the only string taken is "dynamic"' in static
    assert "ProcessSet(_Comm): ringtrain makes process sets from ranks" in mpi_set


def test_process_set_ranks_must_be_integers_as_in_horovod() -> None:
    # horovod/common/process_sets.py: ValueError for any rank that is not an int; int(0.5)
    # would otherwise name rank 0 quietly.
    for ranks, bad in (([0.0, 1.0], "0.0 (float)"), ([0, 1.5], "1.5"), (["0"], "'0' (str)")):
        said = _refused(lambda r=ranks: hvd.ProcessSet(r), CollectiveArgumentError)
        assert said.startswith(f"ProcessSet takes a list of integer ranks, got {bad}"), said
    assert issubclass(CollectiveArgumentError, ValueError)
    # integers of numpy and torch are integers (Horovod's isinstance(rk, int) refuses them)
    assert hvd.ProcessSet([numpy.int64(1), torch.tensor(0)]).ranks == [0, 1]


_MPI_JOB = textwrap.dedent(
    """
    import torch
    from mpi4py import MPI

    import ringtrain.torch as hvd
    from ringtrain.errors import ConfigError

    world = MPI.COMM_WORLD
    hvd.init(comm=world)
    same = hvd.rank() == world.Get_rank()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    hvd.shutdown()
    flipped = world.Split(0, world.Get_size() - 1 - world.Get_rank())
    try:
        hvd.init(comm=flipped)
        said = "accepted"
    except ConfigError as e:
        said = f"rank {world.Get_rank()} same={same} sum={total:g} refused: "
        said += str(e).splitlines()[0]
    # A file per rank: mpirun relays the ranks' output in chunks, and two ranks' lines can
    # meet on one line of its own.
    with open(f"said.{world.Get_rank()}", "w") as f:
        f.write(said)
    """
)


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (openmpi-bin)")
def test_under_mpirun_comm_world_is_taken_and_a_renumbered_split_refused(tmp_path: Path) -> None:
    """Real ``mpirun`` and mpi4py: ``init(comm=MPI.COMM_WORLD)`` gives the communicator's ranks;
    a split that numbers them in reverse is refused on both ranks, naming who is who."""
    script = tmp_path / "job.py"
    script.write_text(_MPI_JOB)
    done = subprocess.run(
        ["mpirun", "-np", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        env=mpirun_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [(tmp_path / f"said.{r}").read_text() for r in range(2)]
    why = "numbers the ranks differently from the job (job rank 0 is its 1, 1 is its 0)"
    for r, line in enumerate(lines):
        assert line.startswith(f"rank {r} same=True sum=2 refused: init(comm=...)"), line
        assert why in line, line


def _sparse_state() -> list[Any]:
    """Fresh optimizers over sparse embeddings: Horovod gives them sparse zero gradients."""
    me = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    sparse_adam = torch.optim.SparseAdam(model[0].parameters(), lr=0.01 * (me + 1))
    hvd.broadcast_optimizer_state(sparse_adam, 0)  # before: dense zeros, which it refuses
    sgd = torch.optim.SGD(model.parameters(), lr=0.1 * (me + 1))
    hvd.broadcast_optimizer_state(sgd, 0, model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert model[0].weight.grad is not None and model[0].weight.grad.is_sparse
    return [sparse_adam.param_groups[0]["lr"], int(sparse_adam.state[model[0].weight]["step"])]


def test_broadcast_optimizer_state_takes_the_model_and_sparse_embeddings(world2: World) -> None:
    assert world2.run(_sparse_state) == [[0.01, 1], [0.01, 1]]


def _duplicate_sets() -> dict[str, Any]:
    n = hvd.size()
    said = {"whole": _refused(lambda: hvd.add_process_set(list(range(n))), ValueError)}
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n  # the job goes on
    hvd.shutdown()
    first, again, whole = hvd.ProcessSet([n - 1]), hvd.ProcessSet([n - 1]), hvd.ProcessSet(range(n))
    hvd.init(process_sets=[first, again, whole])  # as Horovod: the first registers, not the rest
    ids = [first.process_set_id is not None, again.process_set_id, whole.process_set_id]
    sizes = [again.size(), whole.size()]
    if first.included():
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=first).item() == 1
    hvd.shutdown()
    # Nothing new to register: Horovod's init fails ("Horovod initialization failed").
    said["only whole"] = _refused(
        lambda: hvd.init(process_sets=[hvd.ProcessSet(range(n))]), ValueError
    )
    said["initialized after"] = str(hvd.is_initialized())
    hvd.init()
    return {"ids": ids, "sizes": sizes, **said}


def test_a_set_of_the_whole_world_or_a_duplicate_is_handled_as_horovod(world2: World) -> None:
    # horovod/common/process_sets.py add_process_set: ValueError("Attempted to add a duplicate
    # process set") where one with these ranks exists, the global set included; init()'s
    # _init_process_sets invalidates (process_set_id None) a set whose ranks an earlier one or
    # the global set has, and operations.cc fails init() where none of them is new.
    for res in world2.run(_duplicate_sets):
        assert res["ids"] == [True, None, None] and res["sizes"] == [None, None], res
        assert res["whole"].startswith(
            "add_process_set([0, 1]): these are the ranks of the global"
        ), res
        assert "HINT: use hvd.global_process_set" in res["whole"], res
        assert res["only whole"].startswith(
            "init(process_sets=...): no process set given is new"
        ), res
        assert res["initialized after"] == "False", res


@pytest.mark.parametrize(
    ("comm", "said"),
    [
        ([0.0, 1.0], "item 0 is 0.0 (float)"),
        ([0, "1"], "item 1 is '1' (str)"),
        ([0, True], "item 1 is True (bool)"),
    ],
)
def test_comm_ranks_that_are_not_ints_are_a_type_error_as_in_horovod(comm: Any, said: str) -> None:
    # horovod/common/basics.py init(): a list goes to (ctypes.c_int * n)(*comm), whose TypeError
    # ("int expected instead of float") refuses anything but ints; before any rank joins.
    with pytest.raises(TypeError) as e:
        hvd.init(comm=comm)
    msg = str(e.value)
    assert isinstance(e.value, ConfigError) and not hvd.is_initialized()
    assert msg.startswith(f"init(comm={comm!r}): comm's ranks must be ints; {said}"), msg
    assert "HINT: give ranks as ints, e.g. comm=[0, 1], or leave comm out" in msg, msg
