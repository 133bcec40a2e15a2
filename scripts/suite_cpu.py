"""Where the suite's CPU goes: each test's share of the whole machine's busy CPU time.

The suite keeps both cores of a 2-core machine busy, so its wall time follows its CPU time, and
much of that runs where no process tree of pytest's reaches (ranks started over ssh inside the
namespace hosts, Ray's and Spark's daemons). So this charges each test with every core's busy
time (``/proc/stat``, all processes) from its setup to its teardown. Run it serially on a quiet
machine, or tests running side by side are charged each other's work:

    PYTHONPATH=scripts .venv/bin/pytest -p suite_cpu -n 0 -q [paths]

It prints the 40 tests with the most CPU and writes every figure to ``suite-cpu.json``
(``SUITE_CPU_JSON`` to choose the file).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator

import pytest

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
_figures: dict[str, tuple[float, float]] = {}  # test id: (busy CPU s, wall s)


def _busy_s() -> float:
    """Busy CPU seconds of all cores since boot: everything but idle and I/O wait."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) * _TICK_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    busy, wall = _busy_s(), time.monotonic()
    yield
    _figures[item.nodeid] = (_busy_s() - busy, time.monotonic() - wall)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _figures:
        return
    total = sum(cpu for cpu, _ in _figures.values())
    terminalreporter.section(f"busy CPU per test (all processes; {total:.0f} s in all)")
    ranked = sorted(_figures.items(), key=lambda kv: -kv[1][0])
    for nodeid, (cpu, wall) in ranked[:40]:
        terminalreporter.write_line(f"{cpu:8.1f} s CPU {wall:7.1f} s wall  {nodeid}")
    path = os.environ.get("SUITE_CPU_JSON", "suite-cpu.json")
    with open(path, "w") as f:
        json.dump({k: {"cpu_s": c, "wall_s": w} for k, (c, w) in ranked}, f, indent=1)
    terminalreporter.write_line(f"every test's figures: {path}")
