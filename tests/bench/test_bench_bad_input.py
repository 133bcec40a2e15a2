"""Bad ``ringtrain bench`` flags: one clear error (and a HINT where there is more to say), exit
code 2, before any rank starts; never a traceback per rank, nor a value taken silently."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringtrain import cli
from ringtrain.bench import ranks


@pytest.fixture(autouse=True)
def _no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(ranks, "run", refuse)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "rank 0" not in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["allreduce", "--iters", "-1"], "--iters must be >= 0, got -1"),
        (["allreduce", "--fusion-count", "-5"], "--fusion-count must be >= 0"),
        (["allreduce", "--fusion-repeats", "-1"], "--fusion-repeats must be >= 0"),
        (["cpu", "--iters", "-3"], "--iters must be >= 0"),
        (["allreduce", "--link-mbps", "0"], "--link-mbps 0.0: give the link's rate"),
        (["secure", "--link-mbps", "nan"], "--link-mbps nan: give the link's rate"),
        (["allreduce", "--fusion-threshold-mb", "inf"], "--fusion-threshold-mb inf: give a"),
        (["train", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["train", "--lr", "-0.1"], "--lr must be a finite number above 0, got -0.1"),
        (["train", "--lr", "nan"], "--lr must be a finite number above 0, got nan"),
        (["checkpoint", "--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
        (["secure", "--key-file", "/missing/job.key"], "--key-file /missing/job.key: not an"),
        (["converge", "--slow-rank", "2"], "--slow-rank 2 is not a rank of this job of 2"),
        (["converge", "-np", "3", "--slow-rank", "-3"], "--slow-rank -3 is not a rank"),
        (["converge", "--target", "2"], "--target 2.0 cannot be reached on --task digits"),
        (["converge", "--task", "lm", "--target", "0"], "--target 0.0 cannot be reached"),
        (["mixed-speed", "-np", "1"], "--slow-rank 1 is not a rank of this job of 1 ranks"),
        (["mixed-speed", "--slow-rank", "-1"], "--slow-rank -1 is not a rank"),
        (["mixed-speed", "--global-batch", "1"], "--global-batch 1 gives some of the 2 ranks"),
    ],
)
def test_bad_values_are_refused_before_any_rank_starts(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert says in _refused(argv, capsys)


def test_json_and_plot_may_not_be_one_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "ar.out")
    err = _refused(["allreduce", "--json", out, "--plot", out], capsys)
    assert "--json and --plot are the same file" in err and "HINT:" in err


def test_coordinator_checks_its_json_path_before_the_rounds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _refused(["coordinator", "--ranks", "8", "--json", "/etc/passwd/x.json"], capsys)
    assert "/etc/passwd is a file, not a directory" in err and "HINT:" in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["allreduce", "--sizes", "4K..64K:x"], "bad size range '4K..64K:x'"),
        (["converge", "--outer-compression", "int3"], "invalid choice: 'int3'"),
    ],
)
def test_unreadable_values_are_argument_errors(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *argv])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name)
    )
    err = _refused(["allreduce", "--plot", "ar.png"], capsys)
    assert "--plot needs matplotlib" in err and "HINT: pip install 'ringtrain[bench]'" in err


def test_converge_plot_makes_its_folder(tmp_path: Path) -> None:
    from ringtrain.bench import converge

    params = converge.ConvergeParams(task="mlp", variants=("ddp",))
    res = converge.ConvergeResult(2, params, "mse", 0.1, 10, 1e-3)
    out = tmp_path / "new" / "folder" / "c.png"
    converge.plot_converge(res, str(out))
    assert out.read_bytes()[:4] == b"\x89PNG"
