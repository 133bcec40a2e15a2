"""A process limited to a number of CPUs by a cgroup of its own: hosts of set speeds, simulated.

Several ranks on one machine contend for its cores, so one rank slowed by sleeping frees cores
for the others, and no rank runs at a speed of its own. A CPU quota per rank (the kernel's CFS
bandwidth control: ``quota`` microseconds of CPU per ``period``) gives each rank its own
budget: 3 ranks of 0.8, 0.8 and 0.4 CPUs fit 2 cores and behave as 3 hosts of which one runs
at half speed. Every thread of the process counts (Gloo's too), as on a host of that size.

cgroup v2 (``cpu.max``, where the root offers the ``cpu`` controller) or v1 (the ``cpu``
hierarchy's ``cpu.cfs_quota_us``). Needs root.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ringtrain.errors import ConfigError

ROOT = Path("/sys/fs/cgroup")
# Short periods spread a small quota evenly: a step of a few milliseconds is throttled in
# small slices, not one long stop every 100 ms (the kernel's default period).
PERIOD_US = 10_000


def _hierarchy() -> tuple[Path, str]:
    """(the root of the hierarchy with the cpu controller, its version "v2" or "v1")."""
    controllers = ROOT / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return ROOT, "v2"
    if (ROOT / "cpu" / "cpu.cfs_quota_us").is_file():
        return ROOT / "cpu", "v1"
    raise ConfigError(
        "limiting a rank's CPUs needs the cgroup cpu controller (v2's cpu.max or v1's "
        f"cpu.cfs_quota_us), and {ROOT} offers neither.\n"
        "HINT: --slow-by sleep slows a rank without cgroups."
    )


def rank_cpus(fast: float, factor: float, slow: bool) -> float:
    """A rank's CPUs where the fast ranks get ``fast`` and the slow one 1/``factor`` of that."""
    return fast / factor if slow else fast


@contextlib.contextmanager
def cpu_limited(cpus: float, name: str) -> Iterator[None]:
    """This process, every thread of it, limited to ``cpus`` CPUs while the block runs."""
    if not cpus > 0:
        raise ConfigError(f"a CPU limit must be above 0, got {cpus}")
    root, version = _hierarchy()
    group = root / f"{name}-{os.getpid()}"
    quota = max(1000, round(cpus * PERIOD_US))
    try:
        group.mkdir(exist_ok=True)
        if version == "v2":
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        with contextlib.suppress(OSError):
            group.rmdir()
        if isinstance(e, PermissionError):
            raise ConfigError(
                f"cannot limit this rank's CPUs ({e}): cgroups need root.\n"
                "HINT: run as root, or --slow-by sleep."
            ) from None
        # cgroup v2 offers cpu at the root but writes fail where it is not handed down to
        # children ("+cpu" missing from cgroup.subtree_control), e.g. inside a container.
        raise ConfigError(
            f"cannot set a CPU quota in {group} ({e}).\n"
            f"HINT: on cgroup v2, 'echo +cpu > {root}/cgroup.subtree_control' hands the cpu "
            "controller down (as root); or --slow-by sleep."
        ) from None
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            (root / "cgroup.procs").write_text(str(os.getpid()))  # back to the root group
            group.rmdir()
