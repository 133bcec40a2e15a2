"""ringtrain.ray's pure parts: ranks from Ray nodes, Horovod's RayExecutor argument rules."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'ringtrain[ray]'")

from ringtrain.errors import ConfigError
from ringtrain.ray import RayExecutor
from ringtrain.ray.placement import (
    WorkerFacts,
    host_major,
    rank_environment,
    settings_environment,
    specs,
)


def _w(ip: str, pid: int, hostname: str = "same") -> WorkerFacts:
    return WorkerFacts(node_ip=ip, node_id=f"id-{ip}", hostname=hostname, pid=pid)


def test_host_major_groups_each_node_in_order_of_its_first_worker() -> None:
    facts = [_w("b", 1), _w("a", 2), _w("b", 3), _w("a", 4), _w("c", 5)]
    assert host_major(facts) == [0, 2, 1, 3, 4]


def test_two_nodes_with_one_hostname_are_two_hosts() -> None:
    out = specs([_w("10.0.0.1", 1), _w("10.0.0.2", 2)])
    assert [(s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in out] == [
        (0, 1, 0, 2),
        (0, 1, 1, 2),
    ]
    assert [s.host for s in out] == ["10.0.0.1", "10.0.0.2"]


def test_uneven_placement_follows_horovod_cross_groups() -> None:
    out = specs([_w("a", 1), _w("a", 2), _w("b", 3)])
    assert [(s.rank, s.local_rank, s.local_size) for s in out] == [(0, 0, 2), (1, 1, 2), (2, 0, 1)]
    # local rank 0 lives on both hosts, local rank 1 on one: cross sizes 2, 1, 2
    assert [(s.cross_rank, s.cross_size) for s in out] == [(0, 2), (0, 1), (1, 2)]


def test_rank_environment_names_the_host_and_the_store() -> None:
    spec = specs([_w("10.0.0.1", 1), _w("10.0.0.2", 2)])[1]
    env = rank_environment(spec, "10.0.0.1", 1234, "job", store_hosted=False)
    assert env["RINGTRAIN_RANK"] == "1" and env["HOROVOD_SIZE"] == "2"
    assert env["RINGTRAIN_HOSTNAME"] == "10.0.0.2"
    assert env["RINGTRAIN_RENDEZVOUS_ADDR"] == "10.0.0.1"
    assert env["RINGTRAIN_RENDEZVOUS_PORT"] == "1234"
    assert env["RINGTRAIN_RENDEZVOUS_HOSTED"] == "0"


def test_settings_become_ringtrain_variables_and_unknown_ones_are_refused() -> None:
    env = settings_environment({"network_interface": "eth1", "secure": True, "timeout_s": 5})
    assert env == {
        "RINGTRAIN_NETWORK_INTERFACE": "eth1",
        "RINGTRAIN_SECURE": "1",
        "RINGTRAIN_TIMEOUT_S": "5",
    }
    with pytest.raises(ConfigError, match="network_iface"):
        settings_environment({"network_iface": "eth1"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_workers": 4}, "max_workers was given without a positive min_workers"),
        ({"min_workers": 2, "num_workers": 2}, "both min_workers"),
        ({}, "no worker count"),
        ({"num_workers": 2, "num_hosts": 2}, "num_hosts x num_workers_per_host"),
        ({"min_workers": 3, "max_workers": 2}, "below min_workers"),
        ({"num_workers": 2, "gpus_per_worker": 1}, "use_gpu is False"),
        ({"num_workers": 0}, "num_workers must be >= 1"),
        ({"num_workers": 2, "cpus_per_worker": 0}, "cpus_per_worker must be > 0"),
        ({"min_workers": 1, "cooldown_range": [1, 2]}, "cooldown_range is not supported"),
    ],
)
def test_executor_arguments_are_checked_as_horovod_does(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):  # ConfigError is a ValueError, as Horovod's
        RayExecutor(RayExecutor.create_settings(), **kwargs)


def test_executor_refuses_callbacks_it_cannot_call_before_anything_runs() -> None:
    ex = RayExecutor(num_workers=2)  # not started: the refusal comes first
    for call in (ex.run, ex.execute):
        with pytest.raises(ValueError, match=r"callbacks\[1\] is not callable: 'print' \(str\)"):
            call(lambda *_: 1, callbacks=[print, "print"])
    with pytest.raises(ValueError, match=r"run_remote does not wait for the run"):
        ex.run_remote(lambda: 1, callbacks=[print])


def test_executor_without_start_says_so() -> None:
    ex = RayExecutor(num_workers=2)
    with pytest.raises(Exception, match="call start"):
        ex.run(lambda: 1)
