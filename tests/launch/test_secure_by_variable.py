"""Secure mode asked for by variable, not by ``--secure``: ``ringtrain run`` makes the job key
all the same (the ranks had failed "secure mode needs a job key, but none was given")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _launcher_runs import finish
from ringtrain.config import Config
from ringtrain.launch.supervisor import _makes_key

JOB = """
import torch, ringtrain as rt
from ringtrain.runtime import state
rt.init()
assert state.current().config.secure
print("sum", rt.allreduce(torch.ones(2), op=rt.Sum).tolist(), flush=True)
rt.shutdown()
"""


def test_who_makes_the_key() -> None:
    secure = Config(secure=True)
    assert _makes_key(secure, {"secure": True})
    assert _makes_key(secure, {})  # RINGTRAIN_SECURE=1, no key file anywhere
    assert not _makes_key(Config(), {})
    with_file = Config(secure=True, key_file="/k")
    assert not _makes_key(with_file, {})  # both by variable: the ranks read the file
    assert not _makes_key(with_file, {"secure": True, "key_file": "/k"})
    assert _makes_key(with_file, {"secure": True})  # --secure: the launcher's pipe wins


@pytest.mark.timeout(150)
def test_secure_by_x_variable_runs_sealed(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}
    env["OMP_NUM_THREADS"] = "1"
    argv = ["-np", "2", "-x", "RINGTRAIN_SECURE=1", "--", sys.executable, str(script)]
    with open(tmp_path / "out.txt", "w") as out_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringtrain", "run", *argv],
            env=env,
            stdout=out_file,
            stderr=subprocess.PIPE,
            text=True,
        )
        rc, err = finish(proc, timeout=120)
    out = (tmp_path / "out.txt").read_text()
    assert rc == 0, err
    assert out.count("sum [2.0, 2.0]") == 2, out + err
