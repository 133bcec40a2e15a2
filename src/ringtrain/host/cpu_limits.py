"""How much CPU this process may really use: the cgroup CPU quota and SMT siblings.

The affinity mask says which cores a process may run on, not how much CPU time it gets. A
Kubernetes pod in the shared CPU pool (CPU manager policy ``none``, or any pod that is not
Guaranteed with whole CPUs) may run on every core of the node but gets only its CPU limit,
enforced by the CFS quota: cgroup v2 ``cpu.max`` (``"400000 100000"``: 4 CPUs), cgroup v1
``cpu.cfs_quota_us``/``cpu.cfs_period_us``. Threads sized by the cores would be throttled.

The quota is read for this process's own cgroup (``/proc/self/cgroup``) under the cgroup file
systems ``/proc/self/mountinfo`` lists, and every ancestor up to the mount point, since a
parent's limit caps its children too; the smallest wins.

Every function takes ``root``, the directory that stands for ``/``, so tests build a fake
``proc/`` and ``sys/`` tree. Nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

ROOT = Path("/")


def cpu_quota(root: Path = ROOT) -> float | None:
    """CPUs' worth of time this process may use (``2.5``), or None when no quota applies."""
    try:
        memberships = (root / "proc/self/cgroup").read_text()
        mountinfo = (root / "proc/self/mountinfo").read_text()
    except OSError:
        return None
    limits: list[float] = []
    for fstype, mount_root, mount_point, opts in _cgroup_mounts(mountinfo):
        if fstype == "cgroup2":
            path = _member_path(memberships, lambda hid, ctl: hid == "0" and ctl == "")
            read = _read_cpu_max
        elif "cpu" in opts:
            path = _member_path(memberships, lambda hid, ctl: "cpu" in ctl.split(","))
            read = _read_cfs
        else:
            continue
        if path is None:
            continue
        base = root / mount_point.lstrip("/")
        for directory in _up_from(base, _relative(path, mount_root)):
            q = read(directory)
            if q is not None:
                limits.append(q)
    return min(limits) if limits else None


def cpu_budget(cpus: int, quota: float | None) -> int:
    """Whole CPUs the threads of this process (or host) should count on: at least 1."""
    if quota is None:
        return max(1, cpus)
    # 2.5 CPUs of quota keep 2 busy threads unthrottled; 0.5 still needs one thread.
    return max(1, min(cpus, math.floor(quota + 1e-9)))


def is_shared_pool(cpus: int, quota: float | None) -> bool:
    """A quota smaller than the cores one may run on: no exclusive cpuset (shared CPU pool)."""
    return quota is not None and quota < cpus - 1e-9


def smt_siblings(cpus: Iterable[int], root: Path = ROOT) -> dict[int, tuple[int, ...]]:
    """For each CPU, the hardware threads of its core (itself included), as sysfs lists them."""
    out: dict[int, tuple[int, ...]] = {}
    for c in cpus:
        path = root / f"sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list"
        try:
            out[c] = tuple(parse_cpulist(path.read_text()))
        except (OSError, ValueError):
            out[c] = (c,)
    return out


def shared_cores(
    cpus: Sequence[int], siblings: dict[int, tuple[int, ...]]
) -> list[tuple[int, ...]]:
    """The groups of ``cpus`` that are hardware threads of one core (only groups of 2+)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in cpus:
        groups.setdefault(tuple(sorted(siblings.get(c, (c,)))), []).append(c)
    return [tuple(g) for g in groups.values() if len(g) > 1]


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` as a list of CPU numbers."""
    out: list[int] = []
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def _cgroup_mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root inside the hierarchy, mount point, super options) of cgroup mounts."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((tail[0], _unescape(fields[3]), _unescape(fields[4]), set(tail[2].split(","))))
    return out


def _unescape(field: str) -> str:
    # mountinfo writes spaces and a few others as octal escapes (\040).
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _member_path(memberships: str, match: Callable[[str, str], bool]) -> str | None:
    for line in memberships.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if match(hid, controllers):
            return path or "/"
    return None


def _relative(path: str, mount_root: str) -> str:
    """The cgroup's path below the mount (a container may mount its own cgroup as the root)."""
    if mount_root not in ("", "/") and (path == mount_root or path.startswith(mount_root + "/")):
        path = path[len(mount_root) :]
    return path.strip("/")


def _up_from(base: Path, relative: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount point; just the mount point when
    the cgroup is not visible there (a cgroup namespace that shows ``/``)."""
    start = base / relative if relative else base
    if not start.is_dir():
        return [base]
    out = [start]
    while out[-1] != base and base in out[-1].parents:
        out.append(out[-1].parent)
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_cpu_max(directory: Path) -> float | None:
    text = _read(directory / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max":
        return None
    try:
        return int(quota) / int(period or "100000")
    except (ValueError, ZeroDivisionError):
        return None


def _read_cfs(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cpus(root: Path = ROOT) -> int:
    """Whole CPUs this process may keep busy: its affinity mask, capped by its cgroup quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux: count the machine's
        cores = os.cpu_count() or 1
    return cpu_budget(cores, cpu_quota(root))
