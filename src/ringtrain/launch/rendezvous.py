"""Start the job's rendezvous store (:mod:`ringtrain.runtime.rendezvous_server`) as a child.

Run as a separate interpreter so the launcher itself never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import time

from ringtrain.errors import LaunchError

SERVER_MODULE = "ringtrain.runtime.rendezvous_server"


def free_port() -> int:
    """A port that is free now (another process may take it before it is bound again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _listener() -> socket.socket:
    """A socket bound to a free port on every interface and listening: the store's, made here
    so that its port is known before the server has started and is never free between
    (a port chosen free and bound later was once taken meanwhile: EADDRINUSE at start)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", 0))
        s.listen(socket.SOMAXCONN)  # ranks that connect before the server runs wait here
    except OSError:
        s.close()
        raise
    return s


class RendezvousServer:
    def __init__(self, python: str, timeout_s: float, start_timeout_s: float) -> None:
        # The ranks start at the same time as the server, not after it started: they are
        # given the port now, and the server serves on this socket.
        with _listener() as listener:
            self.chosen_port = int(listener.getsockname()[1])
            fd = listener.fileno()
            self._proc = subprocess.Popen(
                [
                    python,
                    "-m",
                    SERVER_MODULE,
                    "--timeout-s",
                    str(timeout_s),
                    "--port",
                    str(self.chosen_port),
                    "--listen-fd",
                    str(fd),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                pass_fds=(fd,),  # the server's copy; the launcher's closes here
                start_new_session=True,  # Ctrl-C in the terminal must not end the store early
            )
        self._start_timeout_s = start_timeout_s
        self._port: int | None = None
        # The server's output, read from its pipe's fd (select sees the fd, not what a Python
        # stream would have buffered): what came after the last whole line.
        self._pending = b""
        self._asked = 0  # CHECK questions sent, each answered with its number

    @property
    def port(self) -> int:
        """Wait for the server to report its port."""
        if self._port is not None:
            return self._port
        assert self._proc.stdout is not None
        deadline = time.monotonic() + self._start_timeout_s
        line, ended = "", False
        while time.monotonic() < deadline:
            got = self._line(min(deadline, time.monotonic() + 0.1))
            if got:
                line = got
                break
            if got == "" or self._proc.poll() is not None:  # its output closed, or it ended
                ended = True
                break
        if not line.startswith("PORT "):
            err = ""
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5.0 if ended else 0.0)
            ended = self._proc.poll() is not None
            if ended and self._proc.stderr is not None:
                err = self._proc.stderr.read()[-2000:]
            self.close()
            if ended:  # its own words say why (ringtrain missing, a bad interpreter)
                raise LaunchError(
                    f"the rendezvous store did not start:\n{err.strip() or '(no output)'}\n"
                    "HINT: the launcher host needs ringtrain installed in the same interpreter."
                )
            raise LaunchError(  # still starting: a busy host
                f"the rendezvous store did not report its port within {self._start_timeout_s:g} "
                "s (--start-timeout).\nHINT: on a busy host starting Python can take longer: "
                "give --start-timeout more seconds."
            )
        self._port = int(line.split()[1])
        return self._port

    def publish(self, key: str, value: str) -> None:
        """Set ``key`` in the store (no spaces in ``key``; no newline in either)."""
        if " " in key or "\n" in key + value:
            raise ValueError(f"cannot publish {key!r}={value!r}")
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"SET {key} {value}\n")
            self._proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise LaunchError(f"the rendezvous store is gone; cannot announce {key}: {e}") from e

    def present(self, keys: list[str], timeout_s: float = 5.0) -> set[str]:
        """Those of ``keys`` that are set in the store (empty if the store does not answer
        within ``timeout_s``). Answers carry their question's number: one that comes after its
        question gave up is skipped, never taken for a later question's (the launcher asks
        about re-form requests and joiners in turn)."""
        if not keys:
            return set()
        assert self._proc.stdin is not None
        self._asked += 1
        try:
            self._proc.stdin.write(f"CHECK {self._asked} " + " ".join(keys) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError) as e:
            raise LaunchError(f"the rendezvous store is gone: {e}") from e
        deadline = time.monotonic() + timeout_s
        while (line := self._line(deadline)) is not None:
            parts = line.split()
            if parts[:2] == ["HAVE", str(self._asked)]:
                return set(parts[2:])
            if not line:
                break  # its output closed
        return set()

    def _line(self, deadline: float) -> str | None:
        """The server's next line; "" once its output closed; None at ``deadline``."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(left, 0.0))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return ""
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode()

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            try:
                self._proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()
