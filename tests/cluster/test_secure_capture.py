"""Between hosts, ``ringtrain run --secure`` puts none of the job's data on the wire.

Two namespace hosts, one rank each, started over ssh by the launcher. Each rank plants known
bytes in a gradient (averaged by ``DistributedOptimizer``) and in objects
(``broadcast_object``, ``allgather_object``), while tcpdump captures each host's link. The
plain run's capture must contain both patterns (otherwise the test could not fail); the secure
run's must contain neither. The loopback variant is ``tests/security/test_capture.py``.
"""

from __future__ import annotations

import secrets
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ringtrain.testing import capture
from ringtrain.testing import cluster as tc

pytestmark = pytest.mark.cluster
CLUSTER = 2
PY = sys.executable

RANK = textwrap.dedent(
    """
    import sys
    import torch
    import ringtrain as rt

    grad_pattern, obj_pattern = bytes.fromhex(sys.argv[1]), bytes.fromhex(sys.argv[2])
    rt.init()
    # d/dw sum(w * c) = c on every rank, so the gradient's bytes are the pattern, and so is
    # their average.
    c = torch.frombuffer(bytearray(grad_pattern * 256), dtype=torch.float32)
    w = torch.nn.Parameter(torch.zeros_like(c))
    opt = rt.DistributedOptimizer(torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)])
    (w * c).sum().backward()
    opt.step()
    assert torch.equal(w.detach(), -c), "the averaged gradient is not the planted one"
    assert rt.broadcast_object({"secret": obj_pattern * 8}, root_rank=0)["secret"] == obj_pattern * 8
    assert rt.allgather_object(obj_pattern * 8) == [obj_pattern * 8] * rt.size()
    print("planted", flush=True)
    rt.shutdown()
    """
)


def _float_pattern() -> bytes:
    """16 random bytes that are 4 float32 values in [1, 2): averaging leaves them unchanged."""
    return b"".join(struct.pack("<I", 0x3F800000 | secrets.randbits(23)) for _ in range(4))


def _captures(cluster: tc.Cluster, tmp_path: Path, tag: str) -> list[capture.PacketCapture]:
    caps: list[capture.PacketCapture] = []
    try:
        for h in cluster.hosts:  # each host's own link: everything it sends or receives
            prefix = ["ip", "netns", "exec", h.netns]
            path = tmp_path / f"{tag}-{h.name}.pcap"
            caps.append(capture.PacketCapture(path, h.interface, prefix, settle_s=0))
    except capture.CaptureUnavailable as e:
        for c in caps:
            c.stop(drain_s=0)
        pytest.skip(str(e))
    time.sleep(capture.SETTLE_S)  # once for all captures
    return caps


def _job(cluster: tc.Cluster, tmp_path: Path, secure: bool, grad: bytes, obj: bytes) -> None:
    script = tmp_path / "plant.py"
    script.write_text(RANK)
    argv = [PY, "-m", "ringtrain", "run", *cluster.launcher_args(slots=1)]
    argv += ["--secure"] if secure else []
    argv += ["--", PY, str(script), grad.hex(), obj.hex()]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("planted") == len(cluster.hosts), proc.stdout + proc.stderr


@pytest.mark.timeout(150)
def test_secure_run_across_hosts_hides_planted_bytes(cluster: tc.Cluster, tmp_path: Path) -> None:
    for secure in (False, True):
        grad, obj = _float_pattern(), secrets.token_bytes(16)
        caps = _captures(cluster, tmp_path, "secure" if secure else "plain")
        try:
            _job(cluster, tmp_path, secure, grad, obj)
        finally:
            time.sleep(capture.DRAIN_S)  # once for all captures
            captured = [c.stop(drain_s=0) for c in caps]
        wire = b"".join(captured)
        assert all(len(c) > 10_000 for c in captured), "a host's capture saw (almost) no traffic"
        if secure:
            assert grad not in wire, "secure mode put a planted gradient on the wire"
            assert obj not in wire, "secure mode put a planted object on the wire"
        else:
            assert grad in wire, "the plain run's capture lacks the gradient: the test is blind"
            assert obj in wire, "the plain run's capture lacks the object: the test is blind"
