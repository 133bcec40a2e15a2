"""A host with a slow link is named network-bound by the straggler report during training."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from ringtrain.testing import cluster as tc
from ringtrain.testing.cluster import HostSpec

pytestmark = pytest.mark.cluster
CLUSTER = [HostSpec(), HostSpec(), HostSpec(rate="10mbit")]

TRAIN = textwrap.dedent(
    """
    import torch
    import ringtrain.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    # ~65k parameters: 0.26 MB of gradients, ~0.2 s per step over a 10 Mbit/s link.
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for _ in range(8):
        opt.zero_grad()
        model(torch.randn(8, 128)).pow(2).mean().backward()
        opt.step()
    import ringtrain
    report = ringtrain.straggler_report()
    if hvd.rank() == 0:
        print("REPORT", report.kind, list(report.ranks), report.hosts, dict(report.link_mb_s))
    """
)


def test_slow_link_host_is_network_bound(cluster: tc.Cluster, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            *cluster.launcher_args(),
            "--straggler-report-steps",
            "4",
            "--",
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "REPORT" in ln)
    assert "REPORT network [2] ('h2',)" in line, line + proc.stderr
    assert "rank 2 on host h2 is network-bound" in proc.stderr


DIGITS = Path(__file__).parents[2] / "examples" / "train_digits.py"


def test_a_report_under_auto_names_its_choice_and_local_updates(
    make_cluster: Callable[[list[HostSpec]], tc.Cluster], tmp_path: Path
) -> None:
    """The new-user trial: --compression auto over 10 Mbit/s, a report at step 20. Before, it
    offered '--compression fp16/powersgd/topk' while topk was in use, from a window that held
    auto's uncompressed measuring steps, and never named local updates."""
    cluster = make_cluster([HostSpec(), HostSpec(rate="10mbit")])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringtrain",
            "run",
            *cluster.launcher_args(),
            "-x",
            "OMP_NUM_THREADS=1",
            "--compression",
            "auto",
            "--straggler-report-steps",
            "20",
            "--",
            sys.executable,
            str(DIGITS),
            "--epochs",
            "1",
            "--target-accuracy",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    chose = next(ln for ln in proc.stderr.splitlines() if "compression=auto chose" in ln)
    method = chose.split("compression=auto chose ")[1].split(":")[0]
    reports = [ln for ln in proc.stderr.splitlines() if "straggler report" in ln]
    assert reports and method in ("topk", "powersgd", "fp16"), chose + "\n".join(reports)
    # The choice is in use: never offered again, and a network verdict names local updates.
    assert "--compression fp16/powersgd/topk" not in proc.stderr, proc.stderr
    if any("network-bound" in r for r in reports):
        assert f"already compressed ({method} (chosen by compression='auto'))" in proc.stderr
        assert "DistributedOptimizer(sync_every=H)" in proc.stderr
