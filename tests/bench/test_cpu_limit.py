"""bench/cpu_limit.py: a rank's CPU quota in a cgroup of its own, removed afterwards; and the
quotas ``bench mixed-speed --slow-by cgroup`` gives each rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ringtrain.bench import cpu_limit, mixed_speed
from ringtrain.errors import ConfigError


def _my_cpu_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or controllers == "":
            return path
    return ""


def test_the_quota_holds_inside_and_the_group_goes_after() -> None:
    try:
        root, version = cpu_limit._hierarchy()
    except ConfigError:
        pytest.skip("no cgroup cpu controller here")
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    before = _my_cpu_cgroup()
    group = root / f"ringtrain-test-{os.getpid()}"
    with cpu_limit.cpu_limited(0.25, "ringtrain-test"):
        assert _my_cpu_cgroup().endswith(group.name)
        if version == "v2":
            assert (group / "cpu.max").read_text().split() == ["2500", "10000"]
        else:
            assert (group / "cpu.cfs_quota_us").read_text().strip() == "2500"
            assert (group / "cpu.cfs_period_us").read_text().strip() == "10000"
    assert _my_cpu_cgroup() == before and not group.exists()


def test_a_bad_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match="above 0"), cpu_limit.cpu_limited(0.0, "x"):
        pass


def test_the_quotas_fill_nine_tenths_of_the_cores_by_default() -> None:
    p = mixed_speed.MixedSpeedParams(slow_rank=1, slow_by="cgroup", factor=2.0)
    cpus = [mixed_speed.rank_cpus(p, 3, r, 2) for r in range(3)]
    assert cpus[1] == pytest.approx(cpus[0] / 2) and cpus[0] == cpus[2]
    assert sum(cpus) == pytest.approx(1.8)
    given = mixed_speed.MixedSpeedParams(slow_rank=0, slow_by="cgroup", factor=4.0, cpus=0.5)
    assert [mixed_speed.rank_cpus(given, 2, r, 2) for r in range(2)] == [0.125, 0.5]


def test_a_cgroup_that_refuses_the_quota_says_how_to_hand_cpu_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cgroup v2 with cpu at the root but not handed down: the child's cpu.max cannot be written.
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    (tmp_path / f"x-{os.getpid()}" / "cpu.max").mkdir(parents=True)  # writing it: an OSError
    monkeypatch.setattr(cpu_limit, "ROOT", tmp_path)
    with (
        pytest.raises(ConfigError, match=r"cgroup.subtree_control") as e,
        cpu_limit.cpu_limited(0.5, "x"),
    ):
        pass
    assert "cpu.max" in str(e.value) and "--slow-by sleep" in str(e.value)
