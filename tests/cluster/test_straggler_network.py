"""A host with a slow link is named network-bound by the straggler report during training."""

from __future__ import annotations

import subprocess
import sys
import textwrap
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
