"""The cgroup cpu controller inside a test cluster's hosts (:mod:`ringtrain.testing.cluster`).

``ip netns exec`` mounts a fresh ``/sys`` for the namespace, which hides the machine's cgroup
mounts. A host runs each command after :data:`CGROUP_CPU`, which mounts the controller again in
that command's own mount namespace (nothing outside the host sees it), so that a job can give a
rank a CPU quota of its own as on a host of that size (``bench mixed-speed --slow-by cgroup``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path


def _cgroup_cpu_mount() -> str:
    """Shell commands that mount the machine's cgroup cpu controller over the fresh ``/sys`` of
    ``ip netns exec`` (in its own mount namespace: nothing outside the host sees them), as the
    machine has it: cgroup v2 with ``cpu``, or v1's ``cpu`` hierarchy; ``true`` otherwise."""
    root = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        if "cpu" in (root / "cgroup.controllers").read_text().split():
            return "mount -t cgroup2 none /sys/fs/cgroup 2>/dev/null || true;"
    if (root / "cpu" / "cpu.cfs_quota_us").is_file():
        return (
            "mount -t tmpfs cgroup_root /sys/fs/cgroup 2>/dev/null && mkdir -p /sys/fs/cgroup/cpu"
            " && mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu 2>/dev/null || true;"
        )
    return "true;"


CGROUP_CPU = _cgroup_cpu_mount()
