"""A SIGTERM (CI's timeout, `kill`) ends a test run like Ctrl-C, fixtures' teardown included.

Ctrl-C reaches every process of the run (the terminal signals the whole process group); a
SIGTERM sent to pytest reaches only the process it names. Without xdist that process runs the
tests: it raises KeyboardInterrupt, and pytest tears the fixtures down. Under xdist it is the
controller, and the fixtures (namespace clusters, sshd, Ray nodes) live in its workers: were it to
stop at once, xdist would kill the workers after 10 s, mid-test, and whatever their fixtures
made would outlive the run. So the controller hands the signal on to its workers, each ends its
test and tears its fixtures down, and xdist then ends the run as after a worker's Ctrl-C. A
second SIGTERM stops the controller at once, and so does the end of GRACE_S: a worker inside a
C call (a collective's wait) handles no signal until the call returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import psutil
import pytest

GRACE_S = 120.0  # for the workers' tests to end and their fixtures to be torn down


def install(config: pytest.Config) -> None:
    """Turn SIGTERM into KeyboardInterrupt in this pytest process (``config``'s), handing it
    to the workers first where this process is an xdist controller."""
    handed_on = False

    def interrupt(signum: int, frame: object) -> None:
        nonlocal handed_on
        # Asked now, not at install: xdist registers its controller after this conftest's hook.
        controller = config.pluginmanager.has_plugin("dsession")
        workers = psutil.Process().children() if controller and not handed_on else []
        if workers:  # a controller runs no test: its only children are its workers
            handed_on = True
            for worker in workers:
                with contextlib.suppress(psutil.Error):
                    worker.send_signal(signal.SIGTERM)
            late = threading.Timer(GRACE_S, os.kill, (os.getpid(), signal.SIGTERM))
            late.daemon = True
            late.start()
            return
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
