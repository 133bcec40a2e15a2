"""Under xdist the workers take the long tests first (tests/conftest.py).

xdist hands the tests out in collection order, one at a time (the groups whole). In file order a
long test could come last: one worker then ran it alone while the other sat idle. So the suite
is ordered by likely cost, each class in collection order: `slow` and namespace-cluster tests,
then tests that start jobs or commands, then test-world and plain tests (fractions of a second).
"""

from __future__ import annotations

from typing import Any

import pytest

# Known tests of each class, checked where the session collected them (the whole suite).
KNOWN = {
    "tests/engine/test_local_update_convergence.py::test_local_updates_reach_synchronous_accuracy": 0,
    "tests/doctor/test_doctor_e2e.py::test_local_doctor_json": 1,
    "tests/launch/test_failing_rank.py": 1,
    "tests/engine/test_buckets.py": 2,
    "tests/collectives/test_edge_shapes.py": 2,
    "tests/doctor/test_doctor_checks.py": 1,
}


def _conftest(config: pytest.Config) -> Any:
    for plugin in config.pluginmanager.get_plugins():
        if str(getattr(plugin, "__file__", "")).endswith("tests/conftest.py"):
            return plugin
    raise AssertionError("tests/conftest.py is not loaded")


def test_under_xdist_the_long_tests_come_first(request: pytest.FixtureRequest) -> None:
    cost_class = _conftest(request.config)._cost_class
    items = request.session.items
    classes = [cost_class(item) for item in items]
    if hasattr(request.config, "workerinput"):  # an xdist worker
        assert classes == sorted(classes), "the session's tests are not ordered by cost class"
    seen = 0
    for item, cls in zip(items, classes):
        for prefix, expected in KNOWN.items():
            if item.nodeid == prefix or item.nodeid.startswith(prefix + "::"):
                assert cls == expected, (item.nodeid, cls, expected)
                seen += 1
    assert seen or len(items) < 100, "none of the known tests was collected: update KNOWN"
