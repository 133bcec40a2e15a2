"""What the tests of jobs started by other launchers (torchrun, by hand) share: a clean
environment, waiting for every process with a limit, and the ranks' ``RESULT`` lines.

The training script they start is tests/cluster/launcher_job.py; each rank prints one
``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ringtrain.testing import cluster as tc

JOB = Path(__file__).with_name("launcher_job.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LIMIT = 200.0
# Variables that could hand ranks a rendezvous: the test process's own must not leak into a job.
_DROP = ("MASTER_", "RINGTRAIN_", "GLOO_", "OMPI_", "PMIX_", "RANK", "WORLD_SIZE", "LOCAL_")
_DROP_LAUNCHERS = ("TORCHELASTIC_", "PET_", "NODE_")
# But torchrun's log directory (tests/conftest.py's, removed when the tests end) is kept.
_LOGS = {k: v for k, v in os.environ.items() if k == "PET_LOG_DIR"}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without anything that could hand ranks a rendezvous."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROP + _DROP_LAUNCHERS)}
    return {**env, **_LOGS, **extra}


def start(
    argv: Sequence[str],
    cwd: Path,
    env: dict[str, str],
    cluster: tc.Cluster | None = None,
    host: str = "",
) -> subprocess.Popen[str]:
    """Start ``argv`` here, or inside ``cluster``'s ``host``: in its own session (so that a
    timeout can stop it with its children), output and errors in one pipe."""
    kwargs: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    kwargs.update(text=True, cwd=cwd, env=env, start_new_session=True)
    if cluster is None:
        return subprocess.Popen(list(argv), **kwargs)
    return cluster.popen(host, argv, **kwargs)


def results(out: str) -> list[dict[str, Any]]:
    """The ranks' ``RESULT`` lines in ``out``, by rank."""
    found = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines() if "RESULT " in ln]
    return sorted(found, key=lambda r: r["rank"])


def finish(procs: list[subprocess.Popen[str]], what: str) -> list[tuple[int, str]]:
    """Wait for every process (each started in its own session); on timeout stop them all,
    their children with them, and fail naming ``what`` did not finish. Exit codes and output."""
    done: list[tuple[int, str]] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=LIMIT)
            done.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        outs = [p.communicate()[0][-3000:] for p in procs]
        raise AssertionError(f"{what} did not finish in {LIMIT}s:\n" + "\n".join(outs)) from None
    return done


def finish_ok(procs: list[subprocess.Popen[str]], what: str) -> list[dict[str, Any]]:
    """:func:`finish`, then assert every process exited 0; the ranks' results, by rank."""
    done = finish(procs, what)
    text = "\n".join(out for _, out in done)
    assert [rc for rc, _ in done] == [0] * len(procs), text[-4000:]
    return results(text)
