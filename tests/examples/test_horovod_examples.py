"""Horovod-style example scripts (our re-creations of the API surface of Horovod's
pytorch_synthetic_benchmark.py and pytorch_mnist.py) run under ``ringtrain run`` with only
``import horovod.torch as hvd`` swapped for ``import ringtrain.torch as hvd``."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# One worker runs the module, so the digits files (the module fixture) are written once.
pytestmark = pytest.mark.xdist_group("horovod-examples")
HERE = Path(__file__).parent
SWAP = ("import horovod.torch as hvd", "import ringtrain.torch as hvd")
HELPERS = ("local_models.py", "digits_mnist.py")


def _prepare(tmp_path: Path, script: str) -> Path:
    source = (HERE / script).read_text()
    assert source.count(SWAP[0]) == 1
    out = tmp_path / script
    out.write_text(source.replace(*SWAP))
    for helper in HELPERS:  # beside the script: Python puts the script's folder on sys.path
        shutil.copy(HERE / helper, tmp_path / helper)
    return out


def _run(np_: int, script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            "-np",
            str(np_),
            "--",
            sys.executable,
            str(script),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=script.parent,
        env={**_env(), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _env() -> dict[str, str]:
    return dict(os.environ)


N_TRAIN, N_TEST = 256, 128


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The MNIST files, written once for the module."""
    root = tmp_path_factory.mktemp("digits")
    _digits_mnist().write_idx(root, N_TRAIN, N_TEST)
    return root


def _by_rank(stdout: str, pattern: str) -> dict[int, tuple[str, ...]]:
    """The pattern's groups on each rank's line (the launcher prefixes lines with [rank])."""
    found = {}
    for line in stdout.splitlines():
        m = re.match(r"\[(\d+)\]\s*" + pattern, line)
        if m:
            found[int(m.group(1))] = m.groups()[1:]
    return found


# Each script at one world size (each job costs seconds of CPU): the benchmark at 2 ranks, MNIST
# at 4, where its sampler splits the data four ways and metric_average averages four values.
@pytest.mark.parametrize("np_", [2])
def test_synthetic_benchmark(tmp_path: Path, np_: int) -> None:
    script = _prepare(tmp_path, "horovod_synthetic_benchmark.py")
    proc = _run(
        np_,
        script,
        "--fp16-allreduce",
        "--batch-size",
        "4",
        "--num-warmup-batches",
        "1",
        "--num-batches-per-iter",
        "2",
        "--num-iters",
        "2",
    )
    assert re.search(rf"\[0\]\s*Total img/sec on {np_} CPU\(s\): [0-9.]+", proc.stdout), proc.stdout
    assert not re.search(r"\[[1-9]\d*\]\s*(Total|Iter)", proc.stdout), "only rank 0 logs"
    weights = _by_rank(proc.stdout, r"weights (\S+)")
    assert sorted(weights) == list(range(np_)), proc.stdout
    assert len({g[0] for g in weights.values()}) == 1, "ranks ended with other weights"


@pytest.mark.parametrize("np_", [4])
def test_mnist(tmp_path: Path, digits: Path, np_: int) -> None:
    shutil.copytree(digits, tmp_path / "data")  # the script writes its lock file there
    script = _prepare(tmp_path, "horovod_mnist.py")
    proc = _run(
        np_,
        script,
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--test-batch-size",
        "32",
        "--log-interval",
        "4",
        "--gradient-predivide-factor",
        "2",
        "--data-dir",
        "data",
    )
    assert re.search(r"\[0\]\s*Train Epoch: 1 \[0/\d+\]", proc.stdout), proc.stdout
    local = _by_rank(proc.stdout, r"local loss (\S+) accuracy (\S+)")
    assert sorted(local) == list(range(np_)), proc.stdout
    final = re.findall(r"\[(\d+)\]\s*Test set: Average loss: (\S+), Accuracy: (\S+)", proc.stdout)
    assert [r for r, _, _ in final] == ["0"], "only rank 0 prints the test result"
    # metric_average is hvd.allreduce with Horovod's default op, Average, of each rank's value.
    for k in (1, 2):
        mean = sum(float(g[k - 1]) for g in local.values()) / np_
        assert float(final[0][k]) == pytest.approx(mean, rel=1e-6)


def _digits_mnist() -> Any:
    """The scripts' helper module (it lives beside them, not on the tests' path)."""
    sys.path.insert(0, str(HERE))
    try:
        import digits_mnist
    finally:
        sys.path.remove(str(HERE))
    return digits_mnist


def test_digits_files_read_back(digits: Path) -> None:
    train = _digits_mnist().MNIST(str(digits), train=True)
    test = _digits_mnist().MNIST(str(digits), train=False)
    assert len(train) == N_TRAIN and len(test) == N_TEST
    img, label = train[0]
    assert img.shape == (28, 28) and img.dtype.is_floating_point is False and label == 0
    assert 0 < int(img.max()) <= 255
