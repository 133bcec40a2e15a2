"""Local and cross numbering from the measured host placement, including uneven ones."""

from __future__ import annotations

import ringtrain as rt
from ringtrain.runtime.topology import from_hosts
from ringtrain.testing.spawn import World


def test_uneven_4_3_1() -> None:
    topo = from_hosts(["a"] * 4 + ["b"] * 3 + ["c"])
    assert topo.describe() == "4-3-1 over 3 host(s)"
    assert [topo.local_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 0]
    assert [topo.local_size(r) for r in range(8)] == [4, 4, 4, 4, 3, 3, 3, 1]
    # Horovod's cross communicator: ranks sharing a local rank
    assert topo.cross_ranks(0) == (0, 4, 7)
    assert topo.cross_size(3) == 1 and topo.cross_rank(7) == 2
    assert topo.cross_groups() == [(0, 4, 7), (1, 5), (2, 6), (3,)]
    assert not topo.is_homogeneous and topo.is_host_major


def test_round_robin_is_not_host_major() -> None:
    topo = from_hosts(["a", "b", "a", "b"])
    assert topo.local_groups() == [(0, 2), (1, 3)]
    assert topo.is_homogeneous and not topo.is_host_major


def _queries() -> tuple[int, int, int, int]:
    return rt.local_rank(), rt.local_size(), rt.cross_rank(), rt.cross_size()


def test_measured_placement_across_ranks(world3: World) -> None:
    hosts = [{"RINGTRAIN_HOSTNAME": h} for h in ("a", "a", "b")]
    assert world3.run(_queries, env=hosts) == [(0, 2, 0, 2), (1, 2, 0, 1), (0, 1, 1, 2)]
