"""Hierarchical allreduce: the pure plan, the cross-host byte model, and equality with a flat
allreduce on real ranks for even, uneven (2-1, 3-1, 2-1-1) and round-robin placements."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist

from ringtrain.errors import CollectiveArgumentError, ConfigError
from ringtrain.testing import spawn
from ringtrain.transport.hierarchical import (
    HierarchicalAllreduce,
    cross_host_bytes,
    plan,
    prefer_hierarchical,
)

# -- the plan, without processes ---------------------------------------------------------------


def test_plan_uneven_4_3_1() -> None:
    p = plan(["a"] * 4 + ["b"] * 3 + ["c"])
    assert p.hosts == ((0, 1, 2, 3), (4, 5, 6), (7,))
    # The cuts of both hosts together: 0, 1/4, 1/3, 1/2, 2/3, 3/4, 1.
    assert [s.start for s in p.segments] == [Fraction(x) for x in ("0", "1/4", "1/3", "1/2")] + [
        Fraction(2, 3),
        Fraction(3, 4),
    ]
    for seg in p.segments:
        assert len(seg.owners) == 3  # one owner per host
        for owner, local in zip(seg.owners, p.hosts, strict=True):
            j = local.index(owner)
            assert Fraction(j, len(local)) <= seg.start and seg.end <= Fraction(j + 1, len(local))
    assert all(seg.owners[2] == 7 for seg in p.segments)  # the lone rank owns everything


@pytest.mark.parametrize(
    "hosts",
    [[0], [0, 0, 0], [0, 1, 2], [0, 0, 1], [0, 1, 0, 1, 1], list("aaaabbbc"), [3, 1, 3, 2, 1, 3]],
)
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 97, 1000])
def test_segments_tile_every_chunk(hosts: list[object], numel: int) -> None:
    """Segments cover [0, numel) once, and each lies inside its owners' phase-1 chunks."""
    p = plan(hosts)
    bounds = [s.bounds(numel) for s in p.segments]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(b[1] == c[0] and b[0] <= b[1] for b, c in itertools.pairwise(bounds))
    for seg, (a, b) in zip(p.segments, bounds, strict=True):
        for owner in seg.owners:
            lo, hi = p.chunk_bounds(owner, numel)
            assert lo <= a and b <= hi


def test_cross_host_bytes_round_robin_vs_host_major() -> None:
    numel = 1_000_003
    rr = [0, 1, 2, 3] * 2
    major = [0, 0, 1, 1, 2, 2, 3, 3]
    flat_rr = cross_host_bytes(rr, numel, scheme="ring")
    flat_major = cross_host_bytes(major, numel, scheme="ring")
    hier_rr = cross_host_bytes(rr, numel)
    hier_major = cross_host_bytes(major, numel)
    # Every hop of a round-robin ring crosses hosts; host-major only every other hop.
    assert flat_rr.total_bytes == pytest.approx(2 * flat_major.total_bytes, rel=1e-5)
    # Hierarchical does not care about the order, and beats both flat rings.
    assert hier_rr == hier_major
    assert hier_rr.total_bytes < flat_major.total_bytes < flat_rr.total_bytes
    # Each of H hosts sends ~2 (H-1)/H of the tensor.
    for sent in hier_rr.sent_by_host:
        assert sent == pytest.approx(2 * 3 / 4 * numel * 4, rel=1e-5)
    assert cross_host_bytes([0, 0, 0], numel).total_bytes == 0
    assert cross_host_bytes([0, 0, 0], numel, scheme="ring").total_bytes == 0


def test_cross_host_bytes_uneven_lone_rank_sends_everything() -> None:
    numel, h = 12_000, 3
    t = cross_host_bytes(list("aaaabbbc"), numel, itemsize=2)
    # Host c's single rank owns every segment: it sends 2 (H-1)/H of the tensor, like the others.
    assert t.sent_by_host[2] == pytest.approx(2 * (h - 1) / h * numel * 2, rel=1e-3)
    assert sum(t.sent_by_host) == t.total_bytes
    with pytest.raises(ConfigError):
        cross_host_bytes([0, 1], 10, scheme="tree")


def test_prefer_hierarchical_from_placement() -> None:
    assert prefer_hierarchical([0, 1, 0, 1])  # round robin: every ring hop crosses
    assert prefer_hierarchical(list("aaaabbbc"))
    assert prefer_hierarchical([0, 0, 1, 1, 2, 2, 3, 3])  # host-major: still fewer bytes
    assert not prefer_hierarchical([0, 0, 0, 0])  # one host: nothing crosses anyway
    assert not prefer_hierarchical([0, 1, 2])  # one rank per host: the same traffic
    assert prefer_hierarchical([0, 1, 2], "on") and not prefer_hierarchical([0, 1, 0, 1], "off")
    with pytest.raises(ConfigError, match="HINT"):
        prefer_hierarchical([0], "yes")


# -- on real ranks ------------------------------------------------------------------------------


def _check_equal_to_flat(host_of_rank: list[object], numels: list[int]) -> int:
    r = dist.get_rank()
    with HierarchicalAllreduce(host_of_rank) as h:
        for numel in numels:
            gen = torch.Generator().manual_seed(1000 * r + numel)
            for dtype in (torch.float32, torch.float64):
                x = torch.randn(numel, generator=gen).to(dtype)
                for op, dop in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
                    want = x.clone()
                    dist.all_reduce(want, op=dop)
                    got = h.allreduce(x.clone(), op=op)
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
            avg = h.allreduce(x.clone().view(-1, 1) if numel else x.clone(), op="avg")
            want = x.clone()
            dist.all_reduce(want)
            torch.testing.assert_close(
                avg.view(-1), want / dist.get_world_size(), rtol=1e-6, atol=1e-7
            )
            ints = torch.randint(-100, 100, (numel,), generator=gen)
            want = ints.clone()
            dist.all_reduce(want)
            assert torch.equal(h.allreduce(ints, op="sum"), want)
        with pytest.raises(CollectiveArgumentError):
            h.allreduce(torch.ones(3, dtype=torch.int64), op="avg")
        return len(h._groups)


NUMELS = [0, 1, 2, 3, 7, 1000, 4099]


@pytest.mark.parametrize("hosts", [[0, 0, 1], [0, 1, 0], ["b", "a", "b"], [0, 1, 2], [0, 0, 0]])
def test_world3_matches_flat_allreduce(world3: spawn.World, hosts: list[object]) -> None:
    world3.run(_check_equal_to_flat, hosts, NUMELS, timeout=60)


@pytest.mark.parametrize("hosts", [[0, 0, 0, 1], [0, 1, 0, 1], [0, 0, 1, 2], [1, 0, 0, 1]])
def test_world4_matches_flat_allreduce(hosts: list[object]) -> None:
    w = spawn.world(4)
    w.run(_check_equal_to_flat, hosts, NUMELS, timeout=90)


def test_world1_and_2(world2: spawn.World) -> None:
    world2.run(_check_equal_to_flat, [0, 1], NUMELS, timeout=60)
    world2.run(_check_equal_to_flat, [0, 0], NUMELS, timeout=60)
    spawn.world(1).run(_check_equal_to_flat, [0], NUMELS, timeout=60)


def _wrong_length() -> None:
    with pytest.raises(ConfigError, match="host_of_rank has"):
        HierarchicalAllreduce([0] * (dist.get_world_size() + 1))


def test_rejects_wrong_placement_length(world2: spawn.World) -> None:
    world2.run(_wrong_length)
