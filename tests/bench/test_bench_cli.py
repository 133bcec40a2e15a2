"""The benchmarks as CI smoke tests: tiny settings, 2 ranks, structure and sanity, never timings.

Each CLI test runs ``ringtrain bench ...`` in-process (it spawns its own 2 ranks), then reads the
JSON it saved. The in-place test runs the benchmark the way a launcher would: on ranks that
already exist (the test world's workers carry the launcher variables).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ringtrain import cli
from ringtrain.errors import ConfigError
from ringtrain.testing.spawn import World

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _positive(summary: dict[str, Any]) -> None:
    assert summary["n"] >= 1
    assert 0 < summary["min"] <= summary["q1"] <= summary["median"] <= summary["q3"]
    assert summary["q3"] <= summary["max"]


def test_allreduce_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "ar.json", tmp_path / "ar.png"
    argv = ["bench", "allreduce", "-np", "2", "--sizes", "4K,64K", "--repeats", "2"]
    argv += ["--fusion-count", "8", "--fusion-size", "4K", "--fusion-repeats", "1"]
    argv += ["--link-mbps", "1000", "--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0

    printed = capsys.readouterr().out
    assert "rt/torch" in printed and "rt/link" in printed and "ringtrain grouped" in printed
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    data = json.loads(out_json.read_text())
    assert data["benchmark"] == "allreduce"
    res = data["result"]
    assert res["world_size"] == 2
    assert res["environment"]["backend"] == "gloo"
    points = {(p["impl"], p["nbytes"]): p for p in res["sizes"]}
    assert set(points) == {(i, b) for i in ("ringtrain", "torch") for b in (4096, 65536)}
    for p in points.values():
        _positive(p["time"])
        _positive(p["busbw"])
        assert p["time"]["n"] == 2 and p["iters"] >= 1
    cases = {f["case"]: f for f in res["fusion"]}
    assert set(cases) == {
        "torch one tensor",
        "torch separate",
        "ringtrain one tensor",
        "ringtrain grouped",
        "ringtrain async",
        "ringtrain engine",
    }
    for f in cases.values():
        _positive(f["time"])
        assert f["nbytes"] == 8 * 4096 and f["vs_one_tensor"] > 0
    assert cases["torch one tensor"]["vs_one_tensor"] == pytest.approx(1.0)
    # Repeat by repeat, torch's case over itself is exactly 1; the others are real ratios.
    assert cases["torch one tensor"]["paired"]["max"] == pytest.approx(1.0)
    assert cases["ringtrain grouped"]["paired"]["n"] == res["params"]["fusion_repeats"]
    assert cases["ringtrain grouped"]["tensors"] == 8
    assert cases["ringtrain engine"]["tensors"] == 8


def test_allreduce_cli_times_the_tcp_transport(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "ar.json"
    argv = ["bench", "allreduce", "-np", "2", "--sizes", "4K,2M", "--repeats", "2", "--tcp"]
    argv += ["--fusion-repeats", "0", "--link-mbps", "1000", "--json", str(out_json)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "tcp/torch" in printed and "tcp/link" in printed
    res = json.loads(out_json.read_text())["result"]
    points = {(p["impl"], p["nbytes"]): p for p in res["sizes"]}
    impls = ("ringtrain", "torch", "tcp")
    assert set(points) == {(i, b) for i in impls for b in (4096, 2 << 20)}
    for p in points.values():
        _positive(p["busbw"])


def test_allreduce_cli_times_reducescatter(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "ar.json"
    # 4M: 2 MiB chunks go around the ring in segments; 64K in one direct round.
    argv = ["bench", "allreduce", "-np", "2", "--sizes", "64K,4M", "--repeats", "2"]
    argv += ["--reducescatter", "--fusion-repeats", "0", "--link-mbps", "1000"]
    assert cli.main([*argv, "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "reducescatter (Sum)" in printed and "(n-1)/n * bytes / time" in printed
    res = json.loads(out_json.read_text())["result"]
    points = {(p["impl"], p["nbytes"]): p for p in res["reducescatter"]}
    assert set(points) == {(i, b) for i in ("ringtrain", "torch") for b in (64 << 10, 4 << 20)}
    for p in points.values():
        _positive(p["busbw"])
        _positive(p["time"])
        assert p["paired"]["n"] == 2
    # Timed after the warm-up, every op of a size rides the fast lane, 4M's too, whose name
    # takes the lane over from 64K's (with one warm-up op, as before, 4M's did not all: checked).
    lanes = res["environment"]["lane_slots"]
    assert {size: (v["taken"], v["lost"]) for size, v in lanes.items()} == {
        size: (v["timed"], 0) for size, v in lanes.items()
    }
    assert "ringtrain's timed ops on the fast lane: 64 KiB 100 of 100, 4 MiB 4 of 4" in printed


def test_train_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "train.json", tmp_path / "train.png"
    argv = ["bench", "train", "-np", "2", "--model", "mlp-1m", "--steps", "2", "--warmup", "1"]
    argv += ["--block", "1", "--batch-size", "8", "--backward-passes-per-step", "2"]
    argv += ["--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0

    printed = capsys.readouterr().out
    assert "comm share" in printed and "nocomm" in printed and "vs ddp, paired" in printed
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    res = json.loads(out_json.read_text())["result"]
    assert res["world_size"] == 2 and res["model"] == "mlp-1m"
    assert res["samples_per_step"] == 8 * 2 * 2
    variants = {v["variant"]: v for v in res["variants"]}
    assert list(variants) == ["ringtrain", "ddp", "nocomm"]
    for v in variants.values():
        _positive(v["step_time"])
        assert v["step_time"]["n"] == 2
        assert v["steps_per_s"] == pytest.approx(1 / v["step_time"]["median"])
        assert v["samples_per_s"] == pytest.approx(res["samples_per_step"] * v["steps_per_s"])
        assert v["vs_ddp"] > 0 and v["vs_nocomm"] > 0 and v["comm_fraction"] < 1
        assert v["paired_vs_ddp"]["n"] == 2  # one ratio per round (blocks of 1 step)
    assert variants["ddp"]["vs_ddp"] == pytest.approx(1.0)
    assert variants["ddp"]["paired_vs_ddp"]["median"] == pytest.approx(1.0)
    assert variants["nocomm"]["comm_fraction"] == pytest.approx(0.0)


def test_secure_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "secure.json", tmp_path / "secure.png"
    argv = ["bench", "secure", "-np", "2", "--sizes", "4K,64K", "--repeats", "2"]
    argv += ["--link-mbps", "1000", "--json", str(out_json), "--plot", str(out_png)]
    assert cli.main(argv) == 0

    printed = capsys.readouterr().out
    assert "secure/plain" in printed and "secure/link" in printed and "ringtrain.init" in printed
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    res = json.loads(out_json.read_text())["result"]
    assert res["world_size"] == 2
    impls = ("gloo", "ringtrain", "ringtrain-secure", "sealed")
    points = {(p["impl"], p["nbytes"]): p for p in res["sizes"]}
    assert set(points) == {(i, b) for i in impls for b in (4096, 65536)}
    for p in points.values():
        _positive(p["time"])
        _positive(p["busbw"])
        assert p["time"]["n"] == 2
    assert set(res["init_time"]) == {"plain", "secure"}
    for s in res["init_time"].values():
        _positive(s)
        assert s["n"] == 2
    assert res["params"]["key_file"], "spawned ranks got a throwaway key file"
    assert not Path(res["params"]["key_file"]).exists(), "and it is gone afterwards"


def test_train_cli_rejects_unknown_variant(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "train", "--variants", "ringtrain,horovod"]) == 2
    assert "horovod" in capsys.readouterr().err


def _in_place() -> Any:
    from ringtrain.bench import ranks
    from ringtrain.bench.allreduce import AllreduceParams, bench_allreduce

    params = AllreduceParams(sizes=(1024,), repeats=1, fusion_count=2, fusion_repeats=1)
    return ranks.run(bench_allreduce, params, np=None, threads=None, settings={}, timeout_s=60)


def _wrong_np() -> str:
    from ringtrain.bench import ranks
    from ringtrain.bench.allreduce import AllreduceParams, bench_allreduce

    try:
        ranks.run(bench_allreduce, AllreduceParams(), np=7, threads=None, settings={}, timeout_s=1)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_runs_in_place_under_a_launcher(world2: World) -> None:
    # The workers carry RINGTRAIN_RANK/SIZE like `ringtrain run` ranks; the benchmark inits itself.
    results = world2.run(_in_place, init=False, timeout=60)
    assert results[1] is None  # only rank 0 reports
    assert results[0].world_size == 2
    assert {p.impl for p in results[0].sizes} == {"ringtrain", "torch"}
    errors = world2.run(_wrong_np, init=False, timeout=30)
    assert all("-np 7" in e and "HINT" in e for e in errors)


def _rank_1_fails(params: None) -> int:
    """Rank 1 raises; rank 0's allreduce then ends because rank 1 left (a consequence)."""
    import torch

    import ringtrain

    if ringtrain.rank() == 1:
        raise ValueError("rank 1's own failure")
    ringtrain.allreduce(torch.ones(4), name="waits.for.rank1")
    return 0


@pytest.mark.timeout(120)
def test_the_rank_that_failed_first_is_shown_not_the_lowest() -> None:
    from ringtrain.bench import ranks
    from ringtrain.errors import LaunchError

    with pytest.raises(LaunchError) as failed:
        ranks.run(_rank_1_fails, None, np=2, threads=1, settings={}, timeout_s=60)
    said = str(failed.value)
    assert said.startswith("the benchmark failed on rank(s) [0, 1]; rank 1 said:\nValueError: ")
    assert "and then:\nrank 0: PeerFailedError: " in said, said


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--timeout", "-1"], "--timeout -1.0: give a number of seconds above 0"),
        (["--timeout", "nan"], "--timeout nan: give a number of seconds above 0"),
        (["--threads", "0"], "--threads 0: give 1 or more"),
        (["--fusion-threshold-mb", "-3"], "fusion_threshold_bytes must be >= 0"),
        (["--cycle-time-ms", "nan"], "cycle_time_ms must be > 0"),
        (["--json", "/etc/passwd/x.json"], "/etc/passwd is a file, not a directory"),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "allreduce", "-np", "2", "--sizes", "4K", "--repeats", "1"]
    assert cli.main([*argv, "--fusion-repeats", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and "rank 0" not in err, err


def test_a_bad_size_names_the_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "allreduce", "--sizes", "4Q"])
    err = capsys.readouterr().err
    assert "argument --sizes: cannot read '4Q' as a size" in err and "HINT: write e.g." in err


def test_help_and_refused_flags_come_without_importing_torch() -> None:
    """``ringtrain bench --help`` (and a flag argparse refuses) answer in a fraction of a
    second: the benchmarks, and torch with them, are imported only to run one."""
    code = (
        "import sys\n"
        "from ringtrain import cli\n"
        "from ringtrain.bench.__main__ import main\n"
        "for run, argv in [(cli.main, ['bench', '--help']), (cli.main, ['bench', 'train', '-h']),\n"
        "                  (cli.main, ['bench', 'allreduce', '--sizes', '4Q']),\n"
        "                  (main, ['mixed-speed', '--help']), (main, ['coordinator', '--rounds', 'x'])]:\n"
        "    try:\n"
        "        run(argv)\n"
        "    except SystemExit as e:\n"
        "        print('EXIT', e.code, flush=True)\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("EXIT 0") == 3 and done.stdout.count("EXIT 2") == 2, done.stdout
    assert "transformer-25m: GPT-like LM" in done.stdout  # bench train's presets, from the catalog
    assert "cannot read '4Q' as a size" in done.stderr and "--rounds: invalid int" in done.stderr
    assert done.stdout.rstrip().endswith("TORCH False"), done.stdout


@pytest.mark.timeout(240)
def test_timeout_gives_up_under_a_launcher_too(tmp_path: Path) -> None:
    # --timeout used to bound only the ranks the bench spawns itself: under `ringtrain run` a
    # run that could not reach its target went on past it (8 min past --timeout 400 at
    # 10 Mbit/s). A target no run reaches, and steps enough for an hour; a short --timeout (its
    # watchdog starts before init(), so it may end the run in any phase: every one is bounded).
    bench = [sys.executable, "-m", "ringtrain", "bench", "converge", "--task", "lm"]
    bench += ["--variants", "alone", "--target", "0.0001", "--max-steps", "1000000"]
    argv = [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--", *bench, "--timeout", "3"]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    took = time.monotonic() - start
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "no result within --timeout 3 s" in done.stdout + done.stderr, done.stderr[-2000:]
    assert took < 120, took
