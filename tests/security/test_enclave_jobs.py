"""Real jobs in the enclave sandbox on one host (loopback): Gloo cannot start there, the TCP
transport runs every collective and trains to the same weights as Gloo outside it.

Ranks run under ``python -m ringtrain.testing.enclave --strict``: any netlink socket, ``flock``,
``MSG_MORE`` send or fork after ``init()`` kills the rank with SIGSYS, failing the job. The
two-host version is ``tests/cluster/test_enclave_cluster.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from _enclave import SANDBOX, STRICT, assert_same_results, load, run_job

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="the enclave sandbox needs Linux seccomp and root (to hide /dev/shm)",
)


@pytest.mark.timeout(600)
def test_enclave_jobs_on_loopback(tmp_path: Path) -> None:
    base = ["-np", "2", "--network-interface", "lo"]
    ref = run_job([*base, "--transport", "gloo"], tmp_path / "gloo", None, tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    reference = load(tmp_path / "gloo", 2)
    assert {r["backend"] for r in reference} == {"gloo"}

    # The reproduction: Gloo in the sandbox fails, with a message that says what to do.
    gloo_in = run_job([*base, "--transport", "gloo"], tmp_path / "x", SANDBOX, tmp_path)
    assert gloo_in.returncode != 0
    assert "Gloo cannot start here" in gloo_in.stdout + gloo_in.stderr
    assert "RINGTRAIN_TRANSPORT=tcp" in gloo_in.stdout + gloo_in.stderr

    for tag, extra in (("plain", []), ("secure", ["--secure"])):
        proc = run_job([*base, "--transport", "tcp", *extra], tmp_path / tag, STRICT, tmp_path)
        assert proc.returncode == 0, f"{tag}:\n{proc.stdout}{proc.stderr}"
        got = load(tmp_path / tag, 2)
        want = "ringtrain_sealed" if extra else "ringtrain_tcp"
        assert {g["backend"] for g in got} == {want}
        assert_same_results(reference, got)


@pytest.mark.timeout(300)
def test_auto_transport_detects_the_missing_netlink(tmp_path: Path) -> None:
    # Gramine's behaviour (EAFNOSUPPORT, not the strict kill): auto tries once, then uses tcp.
    proc = run_job(["-np", "2"], tmp_path / "auto", SANDBOX, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {g["backend"] for g in load(tmp_path / "auto", 2)} == {"ringtrain_tcp"}
