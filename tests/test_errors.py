"""How errors tell what the ranks gave: short at any world size."""

from __future__ import annotations

from ringtrain.errors import by_rank


def test_ranks_that_gave_the_same_share_a_line() -> None:
    assert by_rank(["a", "b", "a"]) == ["  rank(s) 0, 2: a", "  rank(s) 1: b"]
    assert by_rank([[0, 1], [1]], ranks=[4, 6]) == ["  rank(s) 4: [0, 1]", "  rank(s) 6: [1]"]


def test_a_thousand_ranks_give_at_most_six_lines() -> None:
    lines = by_rank([r % 7 for r in range(1024)])
    assert len(lines) == 6 and lines[-1] == "  and 2 other values"
    assert lines[0] == "  rank(s) 0, 7, 14, 21, 28, 35, 42, 49 and 139 more: 0"
