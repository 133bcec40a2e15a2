"""ringtrain.checkpoint saves a ShareSampler's position and resumes there: every sample of the
epoch once across the save and the resume, also when the shares, the global batch or the rank
count changed in between (the ranks are simulated in this process: the position is the same on
every rank, so the checkpoint of one process holds it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

import ringtrain.checkpoint as ckpt
from ringtrain.checkpoint import samplers
from ringtrain.elastic import ElasticSampler
from ringtrain.elastic.share_sampler import ShareSampler
from ringtrain.errors import CheckpointError, ConfigError

DATA = list(range(103))  # not a multiple of any global batch below


def _ranks(shares: list[float], batch: int) -> list[ShareSampler]:
    return [ShareSampler(DATA, batch, shares, r, seed=7) for r in range(len(shares))]


def _take(ranks: list[ShareSampler], steps: int | None = None) -> list[int]:
    """Every rank's samples of ``steps`` global batches (all left if None), each recorded."""
    seen: list[int] = []
    for n, parts in enumerate(zip(*ranks)):
        if steps is not None and n == steps:
            break
        for s, part in zip(ranks, parts):
            seen += part
            s.record_batch()
    return seen


def _saved(tmp_path: Path) -> tuple[str, list[int]]:
    """Epoch 1 at shares [3, 1], 5 global batches of 8 trained on, then saved."""
    ranks = _ranks([3, 1], 8)
    for s in ranks:
        s.set_epoch(1)
    before = _take(ranks, steps=5)
    path = ckpt.save(str(tmp_path / "step-5"), sampler=ranks[0], step=5)
    return path, before


@pytest.mark.parametrize(
    ("shares", "batch"),
    [
        ([3, 1], 8),  # as saved
        ([1, 1], 8),  # other shares after the resume (auto measured again)
        ([1, 2, 1], 12),  # three ranks, another global batch
        ([5], 4),  # one rank
    ],
)
def test_every_sample_once_across_a_save_and_a_resume(
    tmp_path: Path, shares: list[float], batch: int
) -> None:
    path, before = _saved(tmp_path)
    resumed = _ranks(shares, batch)
    for s in resumed:
        restored = ckpt.load(path, sampler=s)
        assert restored.data is s  # iterate the sampler for the rest of the epoch
        assert (s.epoch, s.position) == (1, 40)
        assert s.shares == tuple(float(x) for x in shares)  # its own shares, not the saved ones
    after = _take(resumed, steps=2)
    changed = [2.0] + [1.0] * (len(shares) - 1)  # and auto changes the shares mid-epoch
    for r, s in enumerate(resumed):
        s.reset(changed, r)
    after += _take(resumed)
    assert sorted(before + after) == DATA
    assert len(before + after) == len(DATA)


def test_saved_ranks_must_agree_and_the_order_must_be_the_same() -> None:
    ranks = _ranks([3, 1], 8)
    _take(ranks, steps=2)
    states = [samplers.save(s) for s in ranks]
    assert states[0]["kind"] == "share" and states[0]["shares"] == [3.0, 1.0]
    ranks[1].record_batch()  # rank 1 recorded one batch more
    with pytest.raises(CheckpointError, match=r"(?s)positions differ.*record_batch"):
        samplers.restore(ranks[0], [states[0], samplers.save(ranks[1])], 0, 2)
    other = ShareSampler(DATA[:50], 8, [1, 1], 0, seed=7)
    with pytest.raises(ConfigError, match=r"(?s)length 103 \(now 50\).*HINT"):
        samplers.restore(other, states, 0, 2)
    reseeded = ShareSampler(DATA, 8, [1, 1], 0, seed=8)
    with pytest.raises(ConfigError, match=r"seed 7 \(now 8\)"):
        samplers.restore(reseeded, states, 0, 2)
    unshuffled = ShareSampler(DATA, 8, [1, 1], 0, seed=7, shuffle=False)
    with pytest.raises(ConfigError, match=r"(?s)shuffle 1 \(now 0\).*HINT"):
        samplers.restore(unshuffled, states, 0, 2)
    plain: DistributedSampler[int] = DistributedSampler(DATA, 2, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ShareSampler's position, got DistributedSampler"):
        samplers.restore(plain, states, 0, 2)
    elastic = samplers.save(ElasticSampler(DATA))
    with pytest.raises(ConfigError, match="ElasticSampler's position, got ShareSampler"):
        samplers.restore(ranks[0], [elastic], 0, 1)


def test_a_position_saved_in_extra_before_still_loads() -> None:
    s = ShareSampler(DATA, 8, [1, 1], 0)
    s.load_state_dict({"epoch": 2, "position": 16})  # what state_dict() held until now
    assert (s.epoch, s.position, len(s)) == (2, 16, -(-(103 - 16) // 8))
