"""Enclave jobs across two namespace hosts, started over real ssh by ``ringtrain run``.

Every rank runs under the strict enclave sandbox (``python -m ringtrain.testing.enclave
--strict``: a netlink socket, ``flock``, ``MSG_MORE`` send or fork after ``init()`` kills it with
SIGSYS), with ``--transport tcp --network-interface eth0``; plain and ``--secure`` jobs run every
collective and train to exactly the weights of a Gloo job outside the sandbox.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _enclave import STRICT, assert_same_results, load, run_job
from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = 2


@pytest.mark.timeout(600)
def test_enclave_jobs_across_two_hosts(cluster: tc.Cluster, tmp_path: Path) -> None:
    base = [*cluster.launcher_args(slots=1), "--network-interface", "eth0"]
    ref = run_job([*base, "--transport", "gloo"], tmp_path / "gloo", None, tmp_path)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    reference = load(tmp_path / "gloo", 2)

    # That Gloo cannot start in the sandbox, and says so, is shown on one host
    # (tests/security/test_enclave_jobs.py).
    for tag, extra in (("plain", []), ("secure", ["--secure"])):
        proc = run_job([*base, "--transport", "tcp", *extra], tmp_path / tag, STRICT, tmp_path)
        assert proc.returncode == 0, f"{tag}:\n{proc.stdout}{proc.stderr}"
        got = load(tmp_path / tag, 2)
        want = "ringtrain_sealed" if extra else "ringtrain_tcp"
        assert {g["backend"] for g in got} == {want}
        assert_same_results(reference, got)
