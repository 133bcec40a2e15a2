"""Jobs run at once: a module fixture starts several independent ``ringtrain run`` jobs on one
namespace cluster (each a world with its own ports) and each test checks one of them. Waiting
for them together costs the longest job's time, not the sum. Each job's stdout and stderr go to
files in a folder of its own, so no job blocks on a full pipe while another is awaited."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path


def start(argv: list[str], folder: Path, env: Mapping[str, str]) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "out").open("w") as out, (folder / "err").open("w") as err:
        return subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=dict(env))


@contextlib.contextmanager
def starting() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """A dict for the jobs being started: if starting one fails, those already in it are
    killed, so a failed fixture leaves no job behind."""
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        yield procs
    except BaseException:
        kill(procs)
        raise


def kill(procs: Mapping[str, subprocess.Popen[str]]) -> None:
    """Every job still running, killed and reaped."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def finish(
    procs: Mapping[str, subprocess.Popen[str]], folders: Mapping[str, Path], timeout_s: float
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Waits for every job (killing them all if one overruns); each one's code and output."""
    try:
        for p in procs.values():
            p.wait(timeout=timeout_s)
    finally:
        kill(procs)
    return {
        name: subprocess.CompletedProcess(
            p.args,
            p.returncode,
            (folders[name] / "out").read_text(),
            (folders[name] / "err").read_text(),
        )
        for name, p in procs.items()
    }
