"""ShareSampler: each rank's share of every global batch, every sample once per epoch."""

from __future__ import annotations

import pytest

from ringtrain.elastic.share_sampler import ShareSampler, split_counts
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World

DATA = list(range(103))  # not a multiple of the global batch: the last one is short


def _samplers(shares: list[float], batch: int = 8) -> list[ShareSampler]:
    return [ShareSampler(DATA, batch, shares, r, seed=5) for r in range(len(shares))]


def _take(samplers: list[ShareSampler], steps: int | None = None) -> list[int]:
    """Every rank's indices of ``steps`` global batches (all left if None), recorded."""
    seen: list[int] = []
    for n, parts in enumerate(zip(*samplers)):
        if steps is not None and n == steps:
            break
        for s, part in zip(samplers, parts):
            seen += part
            s.record_batch()
    return seen


def test_split_counts_follow_the_shares_and_sum_to_the_total() -> None:
    assert split_counts(8, [3, 1]) == [6, 2]
    assert split_counts(7, [1, 1, 1]) == [3, 2, 2]  # remainder to the lower rank
    assert split_counts(10, [2.5, 1, 1]) == [6, 2, 2]
    for total in range(0, 40):
        assert sum(split_counts(total, [0.7, 0.2, 0.1])) == total
    with pytest.raises(ConfigError, match="positive"):
        split_counts(8, [1, 0])


def test_a_share_that_rounds_to_nothing_still_gets_one_sample() -> None:
    # batch_shares="auto" on a busy machine once measured a rank at 1% of the speed: its part
    # of an epoch's short last batch (29 samples) rounded to none, and the demo, with no step
    # for that rank, left the batch out (174 samples of 12 epochs never trained on).
    assert split_counts(29, [985, 15]) == [28, 1]
    assert split_counts(64, [998, 1, 1]) == [62, 1, 1]
    assert split_counts(3, [1, 1000, 1000]) == [1, 1, 1]
    assert split_counts(1, [1, 1]) == [1, 0]  # fewer samples than ranks: some get none
    for total in range(2, 70):
        counts = split_counts(total, [0.995, 0.004, 0.001])
        assert sum(counts) == total and min(counts) >= (1 if total >= 3 else 0)


def test_every_sample_once_per_epoch_in_share_sized_parts() -> None:
    samplers = _samplers([3, 1])
    first = [next(iter(s)) for s in samplers]
    assert [len(p) for p in first] == [6, 2]
    seen = _take(samplers)
    assert sorted(seen) == DATA
    for s in samplers:  # a new epoch: a new order, every sample once again
        s.set_epoch(1)
    assert [next(iter(s)) for s in samplers] != first
    assert sorted(_take(samplers)) == DATA


def test_resume_from_a_checkpoint_keeps_the_position() -> None:
    samplers = _samplers([3, 1])
    before = _take(samplers, steps=5)
    saved = [s.state_dict() for s in samplers]
    resumed = _samplers([3, 1])
    for s, state in zip(resumed, saved):
        s.load_state_dict(state)
    assert len(resumed[0]) == -(-(len(DATA) - 40) // 8)
    assert sorted(before + _take(resumed)) == DATA


def test_an_elastic_change_splits_the_rest_without_repeating_or_skipping() -> None:
    samplers = _samplers([3, 1])
    before = _take(samplers, steps=4)
    state = samplers[0].state_dict()  # the same position on every rank
    grown = _samplers([2, 1, 1])  # a third rank joined; new shares
    for s in grown:
        s.load_state_dict(state)
    middle = _take(grown, steps=3)
    for r, s in enumerate(samplers[:1] + grown[1:2]):  # one left: two ranks, shares [1, 4]
        s.load_state_dict(grown[0].state_dict())
        s.reset([1, 4], r)
    after = _take(samplers[:1] + grown[1:2])
    assert sorted(before + middle + after) == DATA


def test_bad_input_is_explained() -> None:
    with pytest.raises(ConfigError, match="rank 2 has no share"):
        ShareSampler(DATA, 8, [1, 1], 2)
    with pytest.raises(ConfigError, match="global_batch_size"):
        ShareSampler(DATA, 0, [1, 1], 0)


def _share_state(world_before: int) -> tuple[list[int], tuple[float, ...], int]:
    """A ShareSampler in TorchState on the job's ranks, its shares made for ``world_before``
    ranks (as before an elastic change): commit, restore, sync, then the rest of the epoch."""
    import ringtrain as rt
    import ringtrain.torch as hvd

    shares = [float(r + 1) for r in range(world_before)]
    mine = ShareSampler(DATA, 8, shares, min(rt.rank(), world_before - 1), seed=5)
    state = hvd.elastic.TorchState(sampler=mine, epoch=0)
    for _ in range(3):
        mine.record_batch()
    state.commit()
    mine.record_batch()  # a batch after the commit: undone by the restore
    state.restore()
    assert mine.position == 24
    mine.position = 24 + 8 * rt.rank()  # ranks disagree: the sync takes rank 0's
    state.sync()
    assert mine.position == 24
    rest = [i for part in mine for i in part]
    return rest, mine.shares, mine.rank


def test_torch_state_keeps_each_rank_s_own_part_after_an_elastic_change(world2: World) -> None:
    for before in (2, 3):  # the same world, then one that had 3 ranks
        results = world2.run(_share_state, before, timeout=60)
        assert [r[2] for r in results] == [0, 1]  # each its own rank, not rank 0's
        shares = results[0][1]
        assert all(r[1] == shares for r in results)
        assert shares == (
            (1.0, 2.0) if before == 2 else (1.0, 1.0)
        )  # equal when they no longer fit
        rest = sorted(i for r in results for i in r[0])
        assert rest == sorted(ShareSampler(DATA, 8, [1, 1], 0, seed=5).order()[24:])
