"""TorchState/ObjectState commit, restore and sync, and @elastic.run's retry on a host update,
written once against rank/size and run at world sizes 1-3."""

from __future__ import annotations

import pytest
import torch

import ringtrain as rt
import ringtrain.torch as hvd
from ringtrain.elastic import state as base
from ringtrain.errors import LaunchError
from ringtrain.testing.spawn import World


def test_object_state_commit_restore_without_a_job() -> None:
    s = base.ObjectState(lambda o: o, lambda o: [o], epoch=0, seen=[1])
    s.epoch, s.seen = 3, [1, 2]
    s.restore()
    assert (s.epoch, s.seen) == (0, [1])
    s.epoch = 5
    s.seen.append(9)
    s.commit()
    s.epoch, s.seen = 6, []
    s.restore()
    assert (s.epoch, s.seen) == (5, [1, 9])


def test_check_host_updates_raises_once_per_announcement() -> None:
    announced = [0]
    s = base.ObjectState(lambda o: o, lambda o: [o], lambda: announced[0], x=1)
    s.check_host_updates()
    announced[0] = 2
    with pytest.raises(hvd.HostsUpdatedInterrupt):
        s.commit()
    s.check_host_updates()  # seen: no second interrupt
    calls: list[int] = []
    s.register_reset_callbacks([lambda: calls.append(1)])
    s.on_reset()
    assert calls == [1]


def test_a_generation_handled_is_handled_for_every_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """@elastic.run re-forms the world for an announcement one state's commit() raised for;
    a second state committed beside it (Horovod's ObjectState next to the TorchState) raised
    again for the same generation, and the run then waited for a world that never came."""
    monkeypatch.setattr(base, "_handled", 0)  # this process's: put back after the test
    announced = [0]
    a = base.ObjectState(lambda o: o, lambda o: [o], lambda: announced[0], x=1)
    b = base.ObjectState(lambda o: o, lambda o: [o], lambda: announced[0], y=2)
    announced[0] = 1
    with pytest.raises(hvd.HostsUpdatedInterrupt):
        a.commit()
    a.mark_generation(1)  # what @elastic.run does once the new world is formed
    b.commit()
    base.ObjectState(lambda o: o, lambda o: [o], lambda: announced[0], z=3).commit()  # made later
    announced[0] = 2  # the next announcement reaches every state
    with pytest.raises(hvd.HostsUpdatedInterrupt):
        b.commit()


def _torch_state() -> list[float]:
    r = rt.rank()
    torch.manual_seed(r)  # different weights on every rank: sync must make them rank 0's
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(12)), shuffle=False)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=r)
    state.sync()
    w0 = model.weight.detach().clone()
    assert state.epoch == 0
    gathered = hvd.allgather_object(w0)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    # a step, then a commit; another step, then restore undoes only the second
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.epoch = 1
    sampler.record_batch(0, 2)
    state.commit()
    committed = model.weight.detach().clone()
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state.epoch = 2
    sampler.record_batch(1, 2)
    state.restore()
    assert torch.equal(model.weight, committed) and state.epoch == 1
    # the commit held every rank's first batch: none of them is handed out again
    assert sampler.processed_indices == set(range(2 * rt.size()))
    assert not set(sampler) & set(range(2 * rt.size()))
    return committed.flatten().tolist()


def test_torch_state_commit_restore_sync(world: World) -> None:
    results = world.run(_torch_state)
    assert all(r == results[0] for r in results)


def _retry_on_host_update() -> list[int]:
    calls: list[int] = []
    state = hvd.elastic.ObjectState(step=0)
    state.register_reset_callbacks([lambda: calls.append(rt.size())])

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> int:
        while state.step < 4:
            state.step += 1
            if state.step == 2 and not calls and rt.rank() == rt.size() - 1:
                state.on_hosts_updated(1)  # one rank hears of new hosts: all must reset
            state.commit()
        return int(hvd.allreduce(torch.tensor(state.step), op=hvd.Sum))

    return [train(state), len(calls)]


def test_run_resets_and_retries_on_a_host_update(world: World) -> None:
    for total, resets in world.run(_retry_on_host_update):
        assert total == 4 * world.size and resets == 1


def _sharded_state_across_a_host_update() -> list[dict[int, float]]:
    model = torch.nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        shard_optimizer=True,
    )
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)

    def adam_steps() -> dict[int, float]:
        return {i: float(s["step"]) for i, s in opt.state_dict()["state"].items()}

    seen: list[dict[int, float]] = []
    state.register_reset_callbacks([lambda: seen.append(adam_steps())])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.batch < 4:
            opt.zero_grad()
            model(torch.ones(2, 2)).sum().backward()
            opt.step()
            state.batch += 1
            if state.batch == 2 and not seen and rt.rank() == 0:
                state.on_hosts_updated(1)
            state.commit()

    train(state)
    return [*seen, adam_steps()]


def test_a_sharded_optimizers_state_survives_a_host_update(world2: World) -> None:
    """A re-formed world drops the old world's shards, and after a HostsUpdatedInterrupt
    nothing restored them: Adam's state was gone after the reset and started over (3 steps at
    the end instead of 5: the 4 batches and the state's initial step of the first sync)."""
    for at_reset, at_end in world2.run(_sharded_state_across_a_host_update):
        assert set(at_reset.values()) == {3.0}  # the commit of batch 2
        assert set(at_end.values()) == {5.0}


def _reset_forever() -> str:
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.ObjectState) -> None:
        state.on_hosts_updated(state._seen_update + 1)
        state.commit()

    try:
        train(state)
    except LaunchError as e:
        return str(e)
    return "no error"


def test_reset_limit_ends_the_retries(world: World) -> None:
    # the variable `ringtrain run --reset-limit 2` gives every rank
    for message in world.run(_reset_forever, env={"RINGTRAIN_ELASTIC_RESET_LIMIT": "2"}):
        assert "re-formed 3 times, more than --reset-limit 2" in message


def test_on_reset_calls_the_states_own_reset_before_the_callbacks() -> None:
    """Horovod's ``State.on_reset``: ``self.reset()`` (a subclass's hook), then the callbacks."""
    calls: list[str] = []

    class Counting(base.ObjectState):
        def reset(self) -> None:
            calls.append("reset")

    s = Counting(lambda o: o, lambda o: [o], x=1)
    s.register_reset_callbacks([lambda: calls.append("callback")])
    s.on_reset()
    assert calls == ["reset", "callback"]
    base.ObjectState(lambda o: o, lambda o: [o], x=1).on_reset()  # the base's: nothing


@pytest.mark.parametrize("failed", [True, False])
def test_a_world_never_announced_names_what_started_the_wait(
    monkeypatch: pytest.MonkeyPatch, failed: bool
) -> None:
    """@elastic.run waits for the launcher's next world after a peer failed or after a
    HostsUpdatedInterrupt; the error when none comes names which one it was."""
    import datetime

    import torch.distributed as dist

    from ringtrain.runtime import membership

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    monkeypatch.setattr(membership._clients, "store", store, raising=False)
    with pytest.raises(hvd.HorovodInternalError) as err:
        membership.next_world(wait_s=0.2, failed=failed)
    said = str(err.value)
    assert said.startswith("no new world was announced within 0 s of ")
    if failed:
        assert "of a collective failing" in said and "chained below" in said
    else:
        assert "of HostsUpdatedInterrupt (raised by a state's commit()" in said
        assert "chained below" not in said


def test_a_rank_that_resets_after_a_failure_says_why_and_asks_for_a_new_world(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where no rank left (the failure was this rank's own transport's), only the rank's request
    brings a new world, and the peers' stall report shows only that this rank is inside the
    wrapper: the rank says what failed and what it waits for, and asks the launcher for its
    world's re-forming (in the store, for its generation), before the wait (a Ray elastic job
    waited so, saying nothing and asking for nothing)."""
    import datetime
    import importlib

    import torch.distributed as dist

    from ringtrain.errors import CollectiveAbortedError, HorovodInternalError
    from ringtrain.launch.elastic import reform_key
    from ringtrain.runtime import membership

    def none_comes(wait_s: float | None = None, failed: bool = True) -> None:
        raise HorovodInternalError("no new world was announced")

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    monkeypatch.setattr(membership._clients, "store", store, raising=False)
    monkeypatch.setattr(membership, "active", lambda env=None: True)
    monkeypatch.setattr(membership, "identity", lambda: 2)
    monkeypatch.setattr(membership, "next_world", none_comes)
    failure = CollectiveAbortedError("a collective failed in transit: boom")
    state = base.ObjectState(lambda o: o, lambda o: [o], x=1)
    run = importlib.import_module("ringtrain.elastic.run")  # the package's `run` is the function
    with caplog.at_level("WARNING", logger="ringtrain"), pytest.raises(HorovodInternalError):
        run._reset(state, failure)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "ringtrain elastic: rank ?: CollectiveAbortedError: a collective failed in transit: "
        "boom; re-forming: asked the launcher for a new world, waiting up to "
        f"{membership.timeout_s():.0f} s for it"
    ], said
    assert store.check([reform_key(membership.current(), 2)])
