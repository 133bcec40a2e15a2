"""Packet captures for tests that check what goes on the wire (secure mode's leak tests).

:class:`PacketCapture` runs ``tcpdump`` writing raw packets (full length, TCP only) to a file,
waits until it is listening, and on :meth:`~PacketCapture.stop` returns the file's bytes, which
a test searches for a planted byte pattern. A pattern must be shorter than a TCP segment and
sent many times over, so that some copy lies whole inside one packet.

``prefix`` runs tcpdump somewhere else, e.g. ``["ip", "netns", "exec", host.netns]`` inside a
host of the test cluster (:mod:`ringtrain.testing.cluster`), with ``interface`` that host's.
Needs root and tcpdump; :class:`CaptureUnavailable` says why not, and tests turn it into a skip.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

# "listening on ..." comes a moment before packets do.
SETTLE_S = 1.0
# On stop, time for tcpdump to write out what the kernel buffered (other jobs add traffic).
DRAIN_S = 2.0


class CaptureUnavailable(RuntimeError):
    """tcpdump is missing or cannot capture here (not root, no such interface...)."""


class PacketCapture:
    """``tcpdump -i INTERFACE -w PATH tcp`` until :meth:`stop`; use as a context manager."""

    def __init__(
        self,
        path: str | Path,
        interface: str = "any",
        prefix: Sequence[str] = (),
        settle_s: float = SETTLE_S,
    ) -> None:
        if shutil.which("tcpdump") is None:
            raise CaptureUnavailable("tcpdump is not installed")
        self.path = Path(path)
        argv = [*prefix, "tcpdump", "-i", interface, "-Z", "root", "-U", "-s", "0"]
        argv += ["-B", "65536", "-w", str(self.path), "tcp"]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
        assert self.proc.stderr is not None
        said = ""
        for _ in range(5):  # "listening on IFACE ..." once it captures
            line = self.proc.stderr.readline().decode(errors="replace")
            said += line
            if "listening" in line or not line:
                break
        if "listening" not in said:
            self.stop()
            raise CaptureUnavailable(f"tcpdump could not capture: {said.strip()}")
        time.sleep(settle_s)

    def __enter__(self) -> PacketCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, drain_s: float = DRAIN_S) -> bytes:
        """End the capture (idempotent) after ``drain_s``; the captured file's bytes."""
        if self.proc.poll() is None:
            time.sleep(drain_s)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return self.path.read_bytes() if self.path.exists() else b""
