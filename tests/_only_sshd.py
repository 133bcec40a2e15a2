"""Waiting until a namespace cluster's hosts hold nothing but their sshd: a finished or killed
job's ranks, agents and ssh sessions are all gone.

A finished job still gets a few seconds: its last processes (the sshd session that carried it,
a rank's helper process) can still be exiting when the launcher returns, longer on a loaded
machine. In CI (stop 72) a check made once, right after the launcher returned, found one such
process on a host; a process still there after the wait is named with its command line.
"""

from __future__ import annotations

import time

import psutil

from ringtrain.testing import cluster as tc


def left_on_hosts(cluster: tc.Cluster) -> dict[str, list[int]]:
    """Each host's processes other than its sshd, for the hosts that have any."""
    left = {}
    for h in cluster.hosts:
        if pids := [p for p in cluster.pids(h.name) if p != cluster.sshd_pid(h.name)]:
            left[h.name] = pids
    return left


def wait_for_only_sshd(
    cluster: tc.Cluster, within: float = 15.0, since: float | None = None
) -> float:
    """Seconds from ``since`` (a ``time.monotonic()``; now by default) until every host holds
    only its sshd; fails, naming what is left, after ``within``."""
    start = time.monotonic() if since is None else since
    while left := left_on_hosts(cluster):
        if time.monotonic() - start > within:
            named = {host: [_named(p) for p in pids] for host, pids in left.items()}
            raise AssertionError(f"left behind on the hosts after {within} s: {named}")
        time.sleep(0.05)
    return time.monotonic() - start


def _named(pid: int) -> str:
    """``pid`` with its command line, so that a failure says which process stayed."""
    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:160]}"
    except psutil.Error:
        return f"{pid} (gone)"
