"""``ringtrain run --network-interface`` across namespace hosts: a name some host lacks is one
error from the launcher, from what each host's agent reported, before any rank starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = [tc.HostSpec(), tc.HostSpec(interface="eth7")]
PY = sys.executable


def _run(cluster: tc.Cluster, tmp_path: Path, spec: str) -> subprocess.CompletedProcess[str]:
    marker = tmp_path / "started"
    return subprocess.run(
        [
            PY,
            "-m",
            "ringtrain",
            "run",
            *cluster.launcher_args(slots=1),
            "--network-interface",
            spec,
            "--start-timeout",
            "60",
            "--",
            PY,
            "-c",
            f"open({str(marker)!r}, 'a').close()",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("nosuch0", "host h0 has no interface named 'nosuch0'"),
        # h0's interface is eth0, h1's eth7: a name right for one host is wrong for the other.
        ("eth0", "host h1 has no interface named 'eth0'; it has: "),
    ],
)
def test_an_interface_a_host_lacks_is_one_error(
    cluster: tc.Cluster, tmp_path: Path, spec: str, says: str
) -> None:
    proc = _run(cluster, tmp_path, spec)
    assert proc.returncode == 2, proc.stderr  # refused as the checks made before ssh are
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("ringtrain run: error: ")]
    assert says in line, proc.stderr
    assert "Traceback" not in proc.stderr and "enforce fail" not in proc.stderr
    assert not (tmp_path / "started").exists()
