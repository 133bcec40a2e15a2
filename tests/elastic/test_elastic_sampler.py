"""ElasticSampler: every sample of an epoch exactly once across a membership change (simulated
in one process: three ranks' samplers committed, their state reloaded by two)."""

from __future__ import annotations

import collections

import pytest

from ringtrain.elastic import ElasticSampler


def _commit(samplers: list[ElasticSampler]) -> dict[str, object]:
    """What TorchState's commit holds: the union of the ranks' processed indices."""
    sd = samplers[0].state_dict()
    sd["processed_indices"] = set().union(*(s.processed_indices for s in samplers))
    return sd


def _run_batches(samplers: list[ElasticSampler], batches: int, batch_size: int) -> list[int]:
    seen = []
    for s in samplers:
        order = list(s)
        for b in range(batches):
            seen += order[b * batch_size : (b + 1) * batch_size]
            s.record_batch(b, batch_size)
    return seen


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_exactly_once_from_3_ranks_to_2(shuffle: bool) -> None:
    data = list(range(60))
    three = [ElasticSampler(data, shuffle, seed=7, num_replicas=3, rank=r) for r in range(3)]
    seen = _run_batches(three, batches=2, batch_size=4)  # 24 samples before the change
    # rank 2 records a batch after the last commit and then dies: that batch is redone
    commit = _commit(three)
    lost = list(three[2])[8:12]
    three[2].record_batch(2, 4)
    two = [ElasticSampler(data, shuffle, seed=7, num_replicas=2, rank=r) for r in range(2)]
    for s in two:
        s.load_state_dict(commit)
    assert sum(len(s) for s in two) == 36  # 60 - 24 divides by 2: no padding
    rest = [i for s in two for i in s]
    counts = collections.Counter(seen + rest)
    assert sorted(counts) == data and set(counts.values()) == {1}
    assert set(lost) <= set(rest)  # the uncommitted batch is trained on after the change


def test_padding_repeats_fewer_than_world_size() -> None:
    data = list(range(25))
    three = [ElasticSampler(data, seed=1, num_replicas=3, rank=r) for r in range(3)]
    seen = _run_batches(three, batches=1, batch_size=3)  # 9 seen, 16 left over 3 ranks
    commit = _commit(three)
    again = [ElasticSampler(data, seed=1, num_replicas=3, rank=r) for r in range(3)]
    for s in again:
        s.load_state_dict(commit)
    rest = [i for s in again for i in s]
    counts = collections.Counter(seen + rest)
    assert sorted(counts) == data
    assert sum(counts.values()) - len(data) == 18 - 16  # padded to 6 per rank


def test_set_epoch_starts_over_with_a_new_order() -> None:
    data = list(range(10))
    s = ElasticSampler(data, num_replicas=1, rank=0)
    first = list(s)
    s.record_batch(0, 5)
    assert len(s.state_dict()["processed_indices"]) == 5
    s.set_epoch(1)
    assert len(s) == 10 and sorted(s) == data and list(s) != first
    assert s.state_dict() == {"epoch": 1, "processed_indices": set()}


def test_record_indices_excludes_them_at_the_next_reset() -> None:
    s = ElasticSampler(list(range(6)), shuffle=False, num_replicas=2, rank=1)
    assert list(s) == [1, 3, 5]
    s.record_indices([0, 1, 2, 3])
    s.reset()
    assert list(s) == [5] and len(s) == 1


def test_horovods_processed_num_is_kept_and_read() -> None:
    """Horovod's sampler keeps a count (``processed_num``): the first indices of the epoch's
    order, which its ranks take in turn. A state saved in that form resumes here alike; here
    the count is read off the indices, not kept beside them."""
    data = list(range(20))
    two = [ElasticSampler(data, True, seed=3, num_replicas=2, rank=r) for r in range(2)]
    _run_batches(two, batches=2, batch_size=3)
    assert [s.processed_num for s in two] == [6, 6]
    done = set().union(*(s.processed_indices for s in two))
    horovods = ElasticSampler(data, True, seed=3, num_replicas=2, rank=0)
    horovods.load_state_dict({"epoch": 0, "processed_num": 12})
    ours = ElasticSampler(data, True, seed=3, num_replicas=2, rank=0)
    ours.load_state_dict(_commit(two))
    assert horovods.processed_indices == done and list(horovods) == list(ours)
    assert horovods.processed_num == 12
