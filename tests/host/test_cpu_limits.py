"""The cgroup CPU quota and SMT siblings, read from fake /proc and /sys trees (a root dir)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ringtrain.host import cpu_limits
from ringtrain.host.cpu_limits import cpu_budget, cpu_quota, is_shared_pool, shared_cores
from ringtrain.launch.tuning import HostFacts, tune

V2_MOUNT = "30 23 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "33 31 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
)


def _tree(root: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


POD = "kubepods.slice/kubepods-burstable.slice/pod1.slice/cri-containerd-abc.scope"


def test_v2_quota_of_the_process_cgroup(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        f"0::/{POD}\n",
        V2_MOUNT,
        {
            f"sys/fs/cgroup/{POD}/cpu.max": "250000 100000\n",
            "sys/fs/cgroup/kubepods.slice/cpu.max": "max 100000\n",
        },
    )
    assert cpu_quota(root) == 2.5


def test_v2_a_parents_smaller_limit_wins(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        f"0::/{POD}\n",
        V2_MOUNT,
        {
            f"sys/fs/cgroup/{POD}/cpu.max": "max 100000\n",
            "sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/pod1.slice/cpu.max": (
                "150000 100000\n"
            ),
        },
    )
    assert cpu_quota(root) == 1.5


def test_v2_no_limit_is_none(tmp_path: Path) -> None:
    root = _tree(
        tmp_path, "0::/user.slice\n", V2_MOUNT, {"sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"}
    )
    assert cpu_quota(root) is None


def test_v2_in_a_cgroup_namespace_reads_the_mount_itself(tmp_path: Path) -> None:
    # A container with its own cgroup namespace sees itself as "/" at the mount point.
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "400000 100000\n"})
    assert cpu_quota(root) == 4.0


def test_v1_cfs_quota(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
        V1_MOUNTS,
        {
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu,cpuacct/docker/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_quota(root) == 3.0


def test_v1_container_mounting_its_own_cgroup_as_root(tmp_path: Path) -> None:
    mounts = "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    root = _tree(
        tmp_path,
        "3:cpu:/docker/abc\n",
        mounts,
        {
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "50000\n",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_quota(root) == 0.5


def test_unreadable_or_absent_is_no_quota(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path) is None
    root = _tree(tmp_path / "r", "0::/x\n", V2_MOUNT, {})
    assert cpu_quota(root) is None
    garbled = _tree(tmp_path / "g", "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "lots\n"})
    assert cpu_quota(garbled) is None


def test_budget_and_shared_pool() -> None:
    assert cpu_budget(64, None) == 64
    assert cpu_budget(64, 2.5) == 2
    assert cpu_budget(64, 0.5) == 1
    assert cpu_budget(4, 8.0) == 4
    assert is_shared_pool(64, 4.0) and not is_shared_pool(4, 4.0) and not is_shared_pool(4, None)


def test_smt_siblings_from_sysfs(tmp_path: Path) -> None:
    topo = "sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"
    files = {topo.format(c): f"{c % 4},{c % 4 + 4}\n" for c in range(8)}
    root = _tree(tmp_path, "0::/\n", V2_MOUNT, files)
    sib = cpu_limits.smt_siblings(range(8), root)
    assert sib[1] == (1, 5) and sib[5] == (1, 5)
    assert shared_cores([0, 1, 2, 3], sib) == []
    assert shared_cores([0, 4, 1, 2], sib) == [(0, 4)]
    assert cpu_limits.smt_siblings([9], root) == {9: (9,)}  # unknown: a core of its own


# ---- the thread and binding plan -------------------------------------------------------------


def test_plan_on_exclusive_cores_is_unchanged_by_a_matching_quota() -> None:
    facts = HostFacts("h", tuple(range(8)), cpu_quota=8.0)
    plan = tune(facts, 2, "auto", "system", {})
    assert [t.cpus for t in plan] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [t.env["OMP_NUM_THREADS"] for t in plan] == ["4", "4"]


def test_plan_in_a_shared_pool_sizes_threads_by_the_quota_and_binds_nothing() -> None:
    # A Burstable pod limited to 4 CPUs on a 64-core node: affinity is every core.
    facts = HostFacts("h", tuple(range(64)), cpu_quota=4.0)
    plan = tune(facts, 2, "auto", "system", {})
    assert [t.cpus for t in plan] == [None, None]
    assert [t.env["OMP_NUM_THREADS"] for t in plan] == ["2", "2"]
    assert "cpu-quota=4" in plan[0].summary
    # Asked to bind anyway: it binds, but the threads still fit the quota.
    bound = tune(facts, 2, "core", "system", {})
    assert bound[0].cpus == tuple(range(32)) and bound[0].env["OMP_NUM_THREADS"] == "2"
    # Fewer CPUs of quota than ranks: one thread each, never zero.
    assert tune(facts, 8, "auto", "system", {})[0].env["OMP_NUM_THREADS"] == "1"
    # The user's own setting still wins.
    assert (
        "OMP_NUM_THREADS" not in tune(facts, 2, "auto", "system", {"OMP_NUM_THREADS": "9"})[0].env
    )


def _in_quota_cgroup(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` inside a fresh child cgroup with 1.5 CPUs of quota (v2 or v1); skips the test
    where this machine does not let root make one."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a cgroup")
    name = f"ringtrain-test-{uuid.uuid4().hex[:8]}"
    candidates = [
        (Path("/sys/fs/cgroup") / name, "cpu.max", "150000 100000"),  # v2
        (Path("/sys/fs/cgroup/cpu") / name, "cpu.cfs_quota_us", "150000"),  # v1
        (Path("/sys/fs/cgroup/cpu,cpuacct") / name, "cpu.cfs_quota_us", "150000"),
    ]
    for d, knob, value in candidates:
        if not (d.parent / knob).exists() and not (d.parent / "cgroup.subtree_control").exists():
            continue
        try:
            d.mkdir()
        except OSError:
            continue
        try:
            try:
                (d / knob).write_text(value)
            except OSError:
                continue
            # The child joins the cgroup itself, then runs the command.
            join = f'echo $$ > {d / "cgroup.procs"} && exec "$@"'
            out = subprocess.run(
                ["sh", "-c", join, "sh", *argv], capture_output=True, text=True, timeout=timeout
            )
            if out.returncode != 0 and "cgroup.procs" in out.stderr:
                continue
            return out
        finally:
            d.rmdir()
    pytest.skip("this machine does not let us make a cgroup with a CPU quota")


def test_real_cgroup_quota_is_what_the_agent_reports() -> None:
    """Optional: where this machine lets root make a child cgroup with a CPU quota."""
    code = "from ringtrain.launch import agent; print(agent.host_facts()['cpu_quota'])"
    out = _in_quota_cgroup([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) == 1.5


def test_real_cgroup_quota_is_flagged_by_the_doctor() -> None:
    """The doctor, run in a 1.5-CPU cgroup on a machine with more cores, calls it shared."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores, so that a 1.5-CPU quota is smaller than the cores")
    argv = [sys.executable, "-m", "ringtrain", "doctor", "--json", "--no-allreduce"]
    out = _in_quota_cgroup(argv)
    report = json.loads(out.stdout)
    assert report["hosts"][0]["facts"]["cpu"]["quota"] == 1.5
    assert any("CPU quota of 1.5 CPUs" in w for w in report["warnings"]), report["warnings"]


def test_ranks_not_started_by_ringtrain_fit_torch_threads_to_the_quota(tmp_path: Path) -> None:
    import torch

    from ringtrain.runtime.state import fit_threads_to_quota

    root = _tree(tmp_path, "0::/\n", V2_MOUNT, {"sys/fs/cgroup/cpu.max": "100000 100000\n"})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert fit_threads_to_quota({"OMP_NUM_THREADS": "2"}, 1, root) is None  # the user's
        assert torch.get_num_threads() == 2
        assert fit_threads_to_quota({}, 1, root) == 1  # 1 CPU of quota: 1 thread
        assert torch.get_num_threads() == 1
        assert fit_threads_to_quota({}, 1, tmp_path / "nothing") is None  # no quota: unchanged
    finally:
        torch.set_num_threads(before)
