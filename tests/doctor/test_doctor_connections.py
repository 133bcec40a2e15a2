"""The doctor shows a rank's computed connections at -np and each host's open-file limits."""

from __future__ import annotations

from typing import Any

from ringtrain.doctor import findings, report
from ringtrain.host import connections, open_files


def _doc(np: int, limits: list[int]) -> dict[str, Any]:
    return {
        "hosts": [{"name": "h0", "reachable": True, "facts": {"open_files": limits}}],
        "placement": {"np": np, "connections": findings.connections_at(np)},
    }


def test_the_figures_are_the_models() -> None:
    c = findings.connections_at(1024)
    assert c["sockets_per_rank"] == {
        name: connections.footprint(1024, uses).sockets
        for name, uses in connections.PROFILES.items()
    }
    assert c["files_up_to"] == connections.most_files(1024)
    assert c["open_files_needed"] == open_files.needed(1024)


def test_the_report_line_names_the_figures_and_the_limits() -> None:
    doc = _doc(1024, [1024, -1])
    (line,) = report._connections(doc)
    c = doc["placement"]["connections"]
    for figure in (*c["sockets_per_rank"].values(), c["files_up_to"], c["open_files_needed"]):
        assert str(figure) in line, line
    assert "h0 1024/unlimited" in line
    assert report._connections({"hosts": [], "placement": {"np": 2}}) == []


def test_a_hard_limit_too_low_for_np_is_a_warning() -> None:
    low = open_files.least(1024) - 1
    (warning,) = findings.check_open_files("h0", {"open_files": [low, low]}, 1024)
    assert warning.startswith("host h0: the open-file limit") and "ulimit -Hn" in warning
    # The agent raises a low soft limit by itself: no warning for that, nor for small jobs.
    assert findings.check_open_files("h0", {"open_files": [1024, 1 << 20]}, 1024) == []
    assert findings.check_open_files("h0", {"open_files": [low, low]}, 8) == []
    assert findings.check_open_files("h0", {}, 1024) == []
