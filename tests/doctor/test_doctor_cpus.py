"""The doctor's CPU checks: a quota without exclusive cores, SMT siblings given to one rank.

Facts as the probe reports them (``cpu.cpus``, ``cpu.quota``, ``cpu.smt_groups``); the probe
reads them with :mod:`ringtrain.host.cpu_limits`, tested over fake cgroup and sysfs trees in
tests/host/test_cpu_limits.py.
"""

from __future__ import annotations

from typing import Any

from ringtrain.doctor import probe
from ringtrain.doctor.findings import check_cpus


def _facts(cpus: int, quota: float | None = None, smt: list[list[int]] | None = None) -> Any:
    return {"cpu": {"cpus": list(range(cpus)), "quota": quota, "smt_groups": smt or []}}


def test_a_quota_smaller_than_the_cores_is_a_shared_pool() -> None:
    [w] = check_cpus("w0", _facts(64, quota=4.0), 2)
    assert "CPU quota of 4 CPUs" in w and "64 cores" in w and "no exclusive cpuset" in w
    assert "Guaranteed" in w and "cpu-manager-policy=static" in w


def test_exclusive_cores_with_a_matching_quota_are_fine() -> None:
    assert check_cpus("w0", _facts(4, quota=4.0), 2) == []
    assert check_cpus("w0", _facts(8), 2) == []


def test_siblings_numbered_side_by_side_land_in_one_rank() -> None:
    # 4 cores x 2 threads, siblings adjacent (0+1, 2+3, ...): 2 ranks get 2 cores each.
    smt = [[0, 1], [2, 3], [4, 5], [6, 7]]
    [w] = check_cpus("h", _facts(8, smt=smt), 2)
    assert "local rank 0" in w and "0+1, 2+3" in w and "4 threads get 2 cores" in w


def test_siblings_numbered_apart_are_not_given_to_one_rank() -> None:
    # Linux's usual numbering: 0-3 one thread of each core, 4-7 their siblings.
    smt = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert check_cpus("h", _facts(8, smt=smt), 2) == []


def test_the_probe_reports_quota_cpus_and_smt_groups() -> None:
    cpu = probe.facts()["cpu"]
    assert cpu["cpus"] and len(cpu["cpus"]) == cpu["usable"]
    assert cpu["quota"] is None or cpu["quota"] > 0
    assert all(len(g) > 1 for g in cpu["smt_groups"])
