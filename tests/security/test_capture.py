"""On the wire, secure mode shows none of the data: a loopback packet capture of a two-rank job
contains a byte pattern planted in tensors and objects in plain mode, and never in secure mode.

Needs tcpdump and root (it captures on every interface, as Gloo may use the host's address); skipped otherwise. The multi-host variant runs
on the namespace test cluster.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import ringtrain as rt
from ringtrain.testing.spawn import World

pytestmark = pytest.mark.skipif(
    shutil.which("tcpdump") is None or os.geteuid() != 0,
    reason="needs tcpdump and root to capture traffic",
)


def _plant(pattern: bytes) -> bool:
    data = torch.frombuffer(bytearray(pattern * 64), dtype=torch.uint8)
    rt.allreduce(data, op=rt.Max, name="planted.allreduce")
    rt.allgather(data, name="planted.allgather")
    rt.broadcast(data, root_rank=0, name="planted.broadcast")
    rt.broadcast_object({"secret": pattern * 8}, root_rank=0)
    rt.allgather_object(pattern * 8)
    return True


class _Capture:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            [
                "tcpdump",
                "-i",
                "any",
                "-Z",
                "root",
                "-U",
                "-s",
                "0",
                "-B",
                "65536",
                "-w",
                str(path),
                "tcp",
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
        )
        assert self.proc.stderr is not None
        said = ""
        for _ in range(5):  # "listening on any ..." once it captures
            line = self.proc.stderr.readline().decode()
            said += line
            if "listening" in line or not line:
                break
        if "listening" not in said:
            self.stop()
            pytest.skip(f"tcpdump could not capture: {said.strip()}")
        time.sleep(1.0)  # "listening" comes a moment before packets do

    def stop(self) -> bytes:
        time.sleep(2.0)  # let tcpdump drain what the kernel buffered (other jobs add traffic)
        self.proc.terminate()
        self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.path.read_bytes() if self.path.exists() else b""


@pytest.mark.timeout(180)
def test_planted_pattern_is_on_the_wire_only_in_plain_mode(
    world2: World, key_file: str, tmp_path: Path
) -> None:
    world2.run(_plant, secrets.token_bytes(16))  # warm: ranks started, torch imported
    for secure in (False, True):
        pattern = secrets.token_bytes(16)
        cap = _Capture(tmp_path / f"secure{int(secure)}.pcap")
        try:
            world2.run(_plant, pattern, secure=secure, key_file=key_file, timeout=60)
        finally:
            captured = cap.stop()
        assert len(captured) > 10_000, "the capture saw (almost) no traffic"
        if secure:
            assert pattern not in captured, "secure mode leaked planted bytes onto the wire"
        else:
            assert pattern in captured, "plain mode's capture lacks the pattern: test is blind"
