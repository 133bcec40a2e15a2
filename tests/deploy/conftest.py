"""``make_cluster``: namespace test clusters (:mod:`ringtrain.testing.cluster`) made inside a
test and removed after it; skips, with the reason, where they cannot be made."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from ringtrain.testing import cluster as tc


@functools.cache
def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the test cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the test cluster needs root to create network namespaces (CI runs as root)"
    missing = tc.missing_tools()
    if missing:
        return f"the test cluster needs {', '.join(missing)}; run scripts/setup as root"
    probe = f"rtdprobe{os.getpid():x}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    return None


@pytest.fixture
def make_cluster() -> Iterator[Callable[[int], tc.Cluster]]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    made: list[tc.Cluster] = []

    def make(hosts: int) -> tc.Cluster:
        c = tc.Cluster(hosts)
        made.append(c)
        return c.up()

    yield make
    for c in made:
        c.down()
