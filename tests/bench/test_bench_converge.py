"""``ringtrain bench converge`` as a smoke test: tiny settings, 2 spawned ranks, structure and
sanity (never timings): every variant runs, the local variant's ranks agree at evaluation, the
table, JSON and plot come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringtrain import cli
from ringtrain.bench import converge, converge_tasks
from ringtrain.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task", converge_tasks.TASKS)
def test_converge_cli(task: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "cv.json", tmp_path / "cv.png"
    argv = ["bench", "converge", "-np", "2", "--threads", "1", "--task", task]
    argv += ["--max-steps", "4", "--eval-every", "2", "--sync-every", "2", "--width", "16"]
    argv += ["--batch-size", "8"]
    if task == "lm":  # the local variants in two fragments, one exchanged every inner step
        argv += ["--outer-fragments", "2"]
    variants = converge.DEFAULT_VARIANTS
    if task == "mlp":  # a slower host, simulated: rank 1 sleeps half its compute time
        argv += ["--slow-rank", "1", "--slow-factor", "1.5"]
        variants = converge.VARIANTS  # with the :steps variants, which need a slow rank
        argv += ["--variants", ",".join(variants)]
    argv += ["--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "converge:" in printed and "local" in printed
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    res = json.loads(out_json.read_text())["result"]
    assert res["world_size"] == 2
    assert [r["variant"] for r in res["runs"]] == list(variants)
    for r in res["runs"]:
        if r["variant"].endswith(":steps"):
            # Rank 0 takes 2 inner steps a round, rank 1 (slow) round(2 / 1.5) = 1, in whole
            # evaluation intervals (a round each) until a rank's budget (4 steps for H=2, 2
            # for H=1) is spent. Overlapped, the first interval also runs to the merge, 1 step
            # late on each rank (3 and 2 steps): rank 1's budget is spent after it.
            r0, r1 = (3, 2) if "overlap" in r["variant"] else (4, 2)
            assert r["steps"] == r0 and r["samples"] == (r0 + r1) * 8
            continue
        ranks = 1 if r["variant"] == "alone" else 2  # alone: every rank is the one host
        assert 0 < r["steps"] <= 4 and r["samples"] == r["steps"] * 8 * ranks
        assert r["seconds"] > 0 and r["curve"]
        assert r["tx_bytes_per_sample"] >= 0
    # The ranks start alike (one seed): the first outer step compares digests, copies nothing.
    assert next(r for r in res["runs"] if r["variant"] == "local")["outer_copies"] == 0
    assert "vs alone" in printed
    assert ("rank 1 at 1/1.5 speed" in printed) is (task == "mlp")
    if task == "mlp":  # issue 40's regression task: about 1M parameters, a loss target
        assert 1_000_000 < res["parameters"] < 1_300_000 and res["metric"] == "mse"
    if task == "lm":
        assert "in 2 fragments" in printed
        _, rate = converge_tasks.markov_chain(0)
        assert res["target"] == pytest.approx(rate + converge_tasks.LM_MARGIN)


def test_markov_chain_is_learnable() -> None:
    """A few likely successors per context: far below the uniform entropy."""
    table, rate = converge_tasks.markov_chain(0)
    assert table.sum(-1).allclose(table.new_ones(()))
    assert 0 < rate < 0.5 * float(torch.log(torch.tensor(converge_tasks.LM_VOCAB)))


def test_bad_variant_is_refused() -> None:
    with pytest.raises(ConfigError, match="HINT"):
        converge.ConvergeParams(variants=("sgd",))
    with pytest.raises(ConfigError, match="--outer-fragments"):
        converge.ConvergeParams(sync_every=4, outer_fragments=5)
    with pytest.raises(ConfigError, match="--slow-factor"):
        converge.ConvergeParams(slow_factor=0.5)
    with pytest.raises(ConfigError, match="need --slow-rank"):
        converge.ConvergeParams(variants=("local:steps",))
