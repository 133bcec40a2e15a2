"""The connection model's figures at 8 to 1,024 ranks (issue 38 item 4), computed, not typed in.

The model itself is checked against sockets measured at 4 ranks in tests/runtime/test_sockets.py;
here its patterns are checked against what the algorithms must do (a broadcast tree reaches
every rank) and its sums at the sizes a real test cannot start.
"""

from __future__ import annotations

import pytest

from ringtrain.host import connections as c
from ringtrain.host.connections import PROFILES, Pattern, footprint, peers

SIZES = (8, 64, 256, 1024)
LIMIT_AT_1024 = 2100  # issue 38's done-when line


def test_ring_talks_to_its_two_neighbours() -> None:
    assert peers(Pattern.RING, 0, 1024) == {1, 1023}
    assert peers(Pattern.RING, 1, 2) == {0}


@pytest.mark.parametrize("size", [2, 3, 5, 8, 13, 64, 100])
def test_every_broadcast_tree_spans_the_group(size: int) -> None:
    for root in range(size):
        edges = {(r, p) for r in range(size) for p in c._tree(r, size, root)}
        assert all((p, r) in edges for r, p in edges)  # both ends know the pair
        reached, frontier = {root}, [root]
        while frontier:
            r = frontier.pop()
            for p in c._tree(r, size, root) - reached:
                reached.add(p)
                frontier.append(p)
        assert reached == set(range(size)), (size, root)
        assert len(edges) // 2 == size - 1  # a tree: every rank but the root has one parent


@pytest.mark.parametrize("size", [8, 64, 1000, 1024])
def test_tree_and_barrier_peers_grow_with_log_n(size: int) -> None:
    bound = 2 * (size - 1).bit_length()
    for rank in (0, 1, size // 2, size - 1):
        assert len(peers(Pattern.TREE, rank, size)) <= bound
        assert len(peers(Pattern.DISSEMINATION, rank, size)) <= bound
    assert len(peers(Pattern.ALL, 3, size)) == size - 1


def test_footprint_of_every_profile_at_1024_ranks() -> None:
    table = {name: [footprint(n, uses).sockets for n in SIZES] for name, uses in PROFILES.items()}
    print(f"sockets per rank at {SIZES}: {table}")  # the figures docs/architecture.md quotes
    # A job on the defaults: the cpu and lane groups connect every pair (sums in rank order).
    assert table["horovod"][-1] <= LIMIT_AT_1024, table
    # Rings and trees only: the sockets grow with log N.
    assert table["rings"][-1] <= 4 * table["rings"][0], table
    # The optimizer's direct rounds connect every pair of the engine group as well.
    assert table["horovod+direct"][-1] > LIMIT_AT_1024, table


def test_sockets_per_group_follow_the_patterns() -> None:
    n = 1024
    f = footprint(n, PROFILES["horovod"])
    by_group = dict(f.by_group)
    # Rings: 2 neighbours; sums in rank order (alltoall): every other rank; vector rounds:
    # one 2-rank group per recursive-doubling partner (log2 N).
    assert by_group == {
        "default": 0,
        "control": 2,
        "cpu": n - 1,
        "engine": 2,
        "lane": n - 1,
        "pairs": 10,
    }
    assert f.gloo_sockets == sum(by_group.values())
    # The store: the job's connection and the world's dozing controller's.
    assert f.store_sockets == c.STORE_CLIENT_SOCKETS + c.STORE_SOCKETS_PER_DOZING_SET


def test_store_reads_at_start_do_not_grow_with_n() -> None:
    for name, uses in PROFILES.items():
        figures = [footprint(n, uses) for n in SIZES]
        assert {f.store_reads_at_start for f in figures} == {0}, name
        # One write per group: the default, the set's kinds and log2 N vector-round pairs.
        groups = [1 + len(c.GROUP_KINDS) + n.bit_length() - 1 for n in SIZES]
        assert [f.store_writes_at_start for f in figures] == groups, name
        # Eagerly every group would read every address: what lazy init saves.
        assert [f.store_reads_eager for f in figures] == [g * n for g, n in zip(groups, SIZES)]


def test_process_sets_and_engine_streams_add_their_own_groups() -> None:
    base = footprint(64, PROFILES["rings"])
    with_set = footprint(64, PROFILES["rings"], process_sets=[(8, PROFILES["rings"])])
    assert with_set.gloo_groups == base.gloo_groups + len(c.GROUP_KINDS) + 3  # 3 pairs at 8
    assert with_set.gloo_sockets == base.gloo_sockets + footprint(8, PROFILES["rings"]).gloo_sockets
    streams = footprint(64, PROFILES["rings"], engine_streams=3)
    assert streams.gloo_groups == base.gloo_groups + 2
    assert streams.gloo_sockets == base.gloo_sockets + 2 * 2  # each one more ring


def test_a_rank_that_serves_the_store_holds_a_socket_per_rank() -> None:
    plain = footprint(1024, PROFILES["horovod"])
    serving = footprint(1024, PROFILES["horovod"], serves_store=True)
    assert serving.sockets - plain.sockets == 1024
    assert footprint(1, PROFILES["horovod"]).sockets == c.STORE_CLIENT_SOCKETS  # never dozes


def test_files_add_each_groups_device() -> None:
    f = footprint(8, PROFILES["horovod"])
    assert f.files == f.sockets + c.FILES_PER_GLOO_GROUP * f.gloo_groups + c.DOORS
    assert c.most_files(1024) >= footprint(1024, PROFILES["horovod+direct"]).files


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8, 12, 13, 64, 100])
def test_recursive_doubling_reaches_every_rank_without_a_deadlock(size: int) -> None:
    """Each rank's steps, run in lockstep (a pair's step runs once both ranks reach it), end
    with every rank holding every rank's part, on pairs made once each."""
    pairs = c.doubling_pairs(size)
    assert len(set(pairs)) == len(pairs)
    steps = {r: c.doubling_steps(r, size) for r in range(size)}
    held = {r: {r} for r in range(size)}
    at = dict.fromkeys(range(size), 0)
    moved = True
    while moved:
        moved = False
        for r in range(size):
            if at[r] == len(steps[r]):
                continue
            a, b = steps[r][at[r]]
            other = b if a == r else a
            if at[other] < len(steps[other]) and steps[other][at[other]] == (a, b):
                held[r] = held[other] = held[r] | held[other]
                at[r] += 1
                at[other] += 1
                moved = True
    assert all(at[r] == len(steps[r]) for r in range(size)), at
    assert all(held[r] == set(range(size)) for r in range(size))
    assert {p for s in steps.values() for p in s} == set(pairs)
    p = 1 << (size.bit_length() - 1)
    extra = 2 if size > p else 0
    assert max(len(s) for s in steps.values()) == p.bit_length() - 1 + extra


@pytest.mark.parametrize(
    ("size", "lengths"),
    [
        (3, [3, 1, 2]),  # p = 2: rank 2 folds into rank 0, which folds, doubles once, sends back
        (5, [4, 2, 2, 2, 2]),
        (6, [4, 4, 2, 2, 2, 2]),
        (8, [3] * 8),  # a power of two: log2 N steps, no folds
    ],
)
def test_a_vector_round_takes_floor_log2_n_steps_plus_2_off_powers_of_two(
    size: int, lengths: list[int]
) -> None:
    """docs/glossary.md (Round): floor(log2 N) steps, plus 2 where N is not a power of two."""
    assert [len(c.doubling_steps(r, size)) for r in range(size)] == lengths
    if size == 3:  # the folds: over the same pair, before and after the doubling
        assert c.doubling_steps(0, 3) == [(0, 2), (0, 1), (0, 2)]
        assert c.doubling_steps(2, 3) == [(0, 2), (0, 2)]


def test_unknown_traffic_and_bad_sizes_are_named() -> None:
    with pytest.raises(ValueError, match="unknown traffic 'teleport'"):
        footprint(8, ["teleport"])
    with pytest.raises(ValueError, match="at least 1 rank"):
        footprint(0, [])
    with pytest.raises(ValueError, match="rank 8 is not in a group of 8"):
        peers(Pattern.RING, 8, 8)


def test_the_docs_table_is_the_models() -> None:
    """docs/launch.md's table of sockets per rank, row by row, is what the model computes."""
    from pathlib import Path

    from ringtrain.host import open_files

    text = (Path(__file__).parents[2] / "docs" / "launch.md").read_text()
    rows = {"rings only": "rings", "the defaults": "horovod", "plus alltoall": "horovod+direct"}
    for start, profile in rows.items():
        (line,) = [row for row in text.splitlines() if row.startswith(f"| {start}")]
        shown = [int(x.replace(",", "")) for x in line.split("|")[2:-1]]
        assert shown == [footprint(n, PROFILES[profile]).sockets for n in SIZES], line
    assert f"({open_files.needed(1024):,} at 1,024 ranks)" in text
