"""Fixtures for tests on the network-namespace test cluster (:mod:`ringtrain.testing.cluster`),
for every test folder (``tests/conftest.py`` loads them as a plugin).

``cluster`` is a module-scoped cluster of 3 plain hosts. A module picks its own hosts with a
module-level ``CLUSTER = 2`` or ``CLUSTER = [HostSpec(...), ...]``, or per test with
``@pytest.mark.parametrize("cluster", [[HostSpec(), HostSpec(interface="eth7")]], indirect=True)``.
``make_cluster(hosts)`` builds extra clusters inside one test and removes them after it.

Everything here skips, with the reason, where namespaces cannot be made: not root, a missing
tool (``scripts/setup`` installs openssh-server and iproute2 when run as root), or a kernel or
container that refuses ``ip netns add``. Tests using these fixtures carry the ``cluster`` marker
(``pytest -m "not cluster"`` leaves them out).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

import pytest

from ringtrain.testing import cluster as tc


@functools.cache
def skip_reason() -> str | None:
    """Why the cluster cannot run here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "the test cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the test cluster needs root to create network namespaces (CI runs as root)"
    missing = tc.missing_tools()
    if missing:
        return (
            f"the test cluster needs {', '.join(missing)}; "
            "run scripts/setup as root to install openssh-server and iproute2"
        )
    probe = f"rtprobe{os.getpid():x}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    return None


def require_cluster() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


HostsArg = int | Sequence[tc.HostSpec]


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[tc.Cluster]:
    """A running cluster: ``cluster.hosts``, ``cluster.ssh_config_path``, ``cluster.exec``."""
    require_cluster()
    hosts: HostsArg = getattr(request, "param", None) or getattr(request.module, "CLUSTER", 3)
    with tc.Cluster(hosts) as c:
        yield c


@pytest.fixture
def cluster_tools() -> None:
    """Skips the test where the cluster cannot run (for tests that make their own)."""
    require_cluster()


@pytest.fixture
def make_cluster() -> Iterator[Callable[[HostsArg], tc.Cluster]]:
    """Build clusters inside one test; each is removed when the test ends, even if it failed."""
    require_cluster()
    made: list[tc.Cluster] = []

    def make(hosts: HostsArg = 2) -> tc.Cluster:
        c = tc.Cluster(hosts)
        made.append(c)
        return c.up()

    yield make
    for c in made:
        c.down()
