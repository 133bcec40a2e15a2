"""``hvd.init()`` adopts a default process group the script created first (issue 27), under
real torchrun: rank and size are the group's, training gives identical weights, and
``hvd.shutdown()`` leaves the script's group usable, as Horovod, which never touches it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(240)
JOB = Path(__file__).with_name("adopt_job.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _env() -> dict[str, str]:
    """This process's environment without anything that could hand ranks a rendezvous."""
    drop = ("MASTER_", "RINGTRAIN_", "GLOO_", "OMPI_", "PMIX_", "RANK", "WORLD_SIZE", "LOCAL_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    # torchrun's log directory (tests/conftest.py's, removed when the tests end) is kept.
    launcher = ("TORCHELASTIC_", "PET_")
    return {k: v for k, v in env.items() if not k.startswith(launcher) or k == "PET_LOG_DIR"}


def _run(mode: str, tmp_path: Path, n: int = 2) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node", str(n), str(JOB), mode],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(),
        timeout=200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    found = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines() if "RESULT " in ln]
    assert len(found) == n, out[-4000:]
    return sorted(found, key=lambda r: r["rank"])


@pytest.mark.parametrize("mode", ["store", "nostore"])
def test_init_adopts_the_scripts_process_group(mode: str, tmp_path: Path) -> None:
    res = _run(mode, tmp_path)
    for r in res:
        assert r["adopted"] and r["launcher"] == "torchrun"
        assert (r["size"], r["dist_rank"]) == (2, r["rank"])
        assert (r["local_rank"], r["local_size"]) == (r["rank"], 2)
        assert r["sum"] == 3.0
        assert r["identical"] and r["trained"]
        assert r["after_shutdown"] == 3.0  # the script's group after hvd.shutdown()
        assert r["again"] == 2.0  # and a second hvd.init() beside it
