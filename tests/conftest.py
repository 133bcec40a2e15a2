"""Shared fixtures: worlds of 1, 2 and 3 ranks, and a guard against leaked state.

Tests written once against ``ringtrain.rank()``/``size()`` run at every world size through the
``world`` fixture. The guard fails a test that leaves environment variables changed, threads
running, or a process group initialized in the test process.

Under pytest-xdist (``make unit``: ``-n auto --dist loadgroup``) every worker keeps its own
worlds (their stores listen on port 0), and the namespace-cluster tests all go to one worker,
in file order, so a module's cluster is made once and no two clusters' jobs share the cores
(the deploy tests, which make their own clusters and share only the key's mount point among
themselves, are a group of their own).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import types
from collections.abc import Iterator

import pytest

import _interrupts
from ringtrain.testing import spawn

# cluster, make_cluster, cluster_tools: the namespace test cluster, for any folder's tests.
pytest_plugins = ["_cluster_fixtures"]


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"np{n}")
def world(request: pytest.FixtureRequest) -> spawn.World:
    """Every test using this runs at world sizes 1, 2 and 3."""
    return spawn.world(request.param)


@pytest.fixture
def world2() -> spawn.World:
    return spawn.world(2)


@pytest.fixture
def world3() -> spawn.World:
    return spawn.world(3)


# The numerics tests that use `capability_world2` run under each ATen CPU capability this CPU
# has: float kernels (and so the last bits of sums) differ between them.
@pytest.fixture(params=spawn.CAPABILITIES)
def capability_world2(request: pytest.FixtureRequest) -> spawn.World:
    """Two ranks running one ATen CPU capability's kernels (``ATEN_CPU_CAPABILITY``), each of
    :data:`spawn.CAPABILITIES` in turn; skipped for one this CPU lacks. The CPU's own choice is the
    shared ``world2``, so only the others start ranks of their own."""
    w = spawn.capability_world(2, request.param)
    if w is None:
        pytest.skip(f"this CPU has no {request.param} kernels")
    return w


@pytest.fixture(autouse=True)
def _rank_start_off_the_clock(request: pytest.FixtureRequest) -> Iterator[None]:
    """The per-test timeout (pyproject's ``timeout``) stops while a world's ranks start.

    Starting ranks (spawn, import torch) has its own deadline (``spawn.START_TIMEOUT_S``) and can
    take minutes on a loaded machine; a test's own budget is for what it runs on them.
    """
    item = request.node
    hook = item.config.hook
    if not hasattr(hook, "pytest_timeout_set_timer"):
        yield
        return
    import pytest_timeout

    def pause() -> None:
        hook.pytest_timeout_cancel_timer(item=item)

    def resume() -> None:
        # A full timeout again, as the plugin reads it (ini, marker, command line).
        hook.pytest_timeout_set_timer(item=item, settings=pytest_timeout._get_item_settings(item))

    spawn.start_hooks.append((pause, resume))
    try:
        yield
    finally:
        spawn.start_hooks.remove((pause, resume))


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    env = dict(os.environ)
    threads = {t.ident for t in threading.enumerate()}
    yield
    leaked_env = {k for k in set(env) ^ set(os.environ)} | {
        k for k in env if os.environ.get(k) != env[k]
    }
    # torch sets TORCHINDUCTOR_* itself on first use of torch.optim (its dynamo import).
    leaked_env = {k for k in leaked_env if not k.startswith(("PYTEST_", "TORCHINDUCTOR_"))}
    assert not leaked_env, f"test changed environment variables: {sorted(leaked_env)}"
    # pytest-timeout's own timer is not the test's: a world's start replaces it with a new one
    # (_rank_start_off_the_clock), whose thread id may be new.
    new_threads = [
        t
        for t in threading.enumerate()
        if t.ident not in threads
        and t.is_alive()
        and not t.daemon
        and not t.name.startswith("pytest_timeout ")
    ]
    for t in new_threads:  # one that is ending (a timer that has just fired) is no leak
        t.join(2.0)
    new_threads = [t for t in new_threads if t.is_alive()]
    assert not new_threads, f"test left threads running: {[t.name for t in new_threads]}"
    import sys

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        assert not dist.is_initialized(), "test left the default process group initialized"


CLUSTER_FIXTURES = {"cluster", "make_cluster", "cluster_tools"}

# The `processes` marker, by rule (`make check` runs the tests without it): a test starts
# processes when it uses a fixture that starts them, or when its module (or a tests/ helper
# module it imports from) uses one of these modules: a test world's ranks, a cluster, a
# launcher's job (`ringtrain run`/`bench` through the CLI, Ray, Spark) or any command.
PROCESS_FIXTURES = {"world", "world2", "world3", "capability_world2"} | CLUSTER_FIXTURES
PROCESS_MODULES = (
    "subprocess",
    "multiprocessing",
    "ringtrain.testing",
    "ringtrain.cli",
    "ringtrain.launch.agent",
    "ringtrain.launch.supervisor",
    "ringtrain.ray",
    "ringtrain.spark",
    "ray",
    "pyspark",
)
TESTS = os.path.dirname(os.path.abspath(__file__))


def _uses_process_modules(module: types.ModuleType, depth: int = 1) -> bool:
    """Whether ``module`` binds a process-starting module or anything defined in one; a helper
    module of tests/ it binds from (``_elastic_grow.run_job``) is looked into ``depth`` deep."""
    for value in vars(module).values():
        name = value.__name__ if isinstance(value, types.ModuleType) else None
        name = name or getattr(value, "__module__", None)
        if not isinstance(name, str) or name == module.__name__:
            continue
        if any(name == m or name.startswith(m + ".") for m in PROCESS_MODULES):
            return True
        helper = sys.modules.get(name)
        if helper is None or not depth or not _in_tests(helper):
            continue
        if _uses_process_modules(helper, depth - 1):
            return True
    return False


def _in_tests(module: types.ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    return path is not None and os.path.abspath(path).startswith(TESTS + os.sep)


def _starts_processes(item: pytest.Item) -> bool:
    if item.get_closest_marker("cluster"):
        return True
    if set(getattr(item, "fixturenames", ())) & PROCESS_FIXTURES:
        return True
    module = getattr(item, "module", None)
    return module is not None and _uses_process_modules(module)


# tryfirst: xdist's own hook turns the xdist_group marker into the scheduling group, so the
# marker must be on the item before that hook runs. Known gap: under pytest 9, xdist 3.8's hook
# writes item._nodeid, which pytest 9 no longer reads, so the group has no effect there
# (pyproject.toml holds pytest below 9 for that reason).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.processes)
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("xdist_group"):
            continue  # a module that names its own group (tests/deploy/test_execute.py)
        if item.get_closest_marker("cluster") or fixtures & CLUSTER_FIXTURES:
            item.add_marker(pytest.mark.xdist_group("cluster"))


# Where torchrun keeps its ranks' logs (its --log-dir).
TORCHRUN_LOG_DIR = "PET_LOG_DIR"


def pytest_configure(config: pytest.Config) -> None:
    # A SIGTERM (CI's timeout, `kill`) ends the run like Ctrl-C, in xdist's workers too: pytest
    # then tears their fixtures down, so namespace clusters, sshd and Ray nodes do not outlive it.
    _interrupts.install(config)
    # torchrun (the tests', Spark's) keeps its ranks' logs in a directory it makes in /tmp and
    # never removes, unless told where: here, one this process removes when it ends.
    if TORCHRUN_LOG_DIR not in os.environ:
        os.environ[TORCHRUN_LOG_DIR] = tempfile.mkdtemp(prefix="ringtrain-tests-torchrun-")
        config.add_cleanup(_remove_torchrun_logs)


def _remove_torchrun_logs() -> None:
    shutil.rmtree(os.environ.pop(TORCHRUN_LOG_DIR), ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    spawn.close_all()
