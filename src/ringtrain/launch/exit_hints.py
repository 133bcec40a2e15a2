"""What to do about a rank that failed on a module it could not import or a script not there.

Under ``ringtrain run`` both usually mean that the ranks' command is not what the user ran by
hand: ``python`` on the ranks' PATH is another Python than the one with the packages (a virtual
environment not activated: the ranks get the launcher's PATH), a Horovod script still imports
``horovod``, or the script is not at the same path on another host (the launcher copies no
files). The agent runs in the Python that has ringtrain on its host, so it can say which Python
the rank ran and whether the agent's own has the module. Pure but for looking things up on
this host; the supervisor prints the lines after the root cause's last words (``failures``).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Sequence
from importlib.machinery import PathFinder

_NO_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")
_NO_FILE = re.compile(r"can't open file '(.+)': \[Errno 2\]")
# A traceback's last line is the error; a chained one or the runtime's own farewell can follow.
_LAST_LINES = 5


def for_exit(tail: Sequence[str], argv: Sequence[str], path: str | None) -> list[str]:
    """HINT lines for a rank whose error output ended with ``tail``, which ran ``argv`` with
    ``path`` as its PATH; none where neither case is in its last lines."""
    for line in reversed(tail[-_LAST_LINES:]):
        if m := _NO_MODULE.search(line):
            return [_missing_module(m.group(1), argv, path)]
        if m := _NO_FILE.search(line):
            return [
                f"HINT: that host has no file {m.group(1)}. ringtrain run starts the same "
                "command on every host and copies no files: check the path, and with several "
                "hosts put the script at that path on each (a shared file system, or a copy)."
            ]
    return []


def _missing_module(name: str, argv: Sequence[str], path: str | None) -> str:
    top = name.partition(".")[0]
    if top == "horovod":
        return (
            "HINT: ringtrain runs Horovod scripts after one change: import ringtrain.torch as "
            "hvd (was: import horovod.torch as hvd); docs/horovod.md maps the rest."
        )
    python = rank_python(argv, path)
    ran = "the rank's Python"
    if python is not None:
        ran = python if python == argv[0] else f"{python} (its command's {argv[0]!r})"
    if python is not None and not _same_environment(python, sys.executable) and _have(top):
        return (
            f"HINT: the rank ran {ran}, which has no {top!r}; the Python ringtrain runs in on "
            f"that host has it: {sys.executable}. Name that one (ringtrain run ... -- "
            f"{sys.executable} ...), or activate its environment before ringtrain run (the "
            "ranks get the launcher's PATH)."
        )
    return (
        f"HINT: install the package that provides {top!r} into {ran} on that host (every "
        "host runs the same command), or, for a module of your own, set PYTHONPATH (ringtrain "
        "run passes it to the ranks)."
    )


def rank_python(argv: Sequence[str], path: str | None) -> str | None:
    """The interpreter a command names first (``python3``, ``/venv/bin/python``), as found on
    ``path``; None for any other command (a script's ``#!`` line, ``uv run``: their own)."""
    program = argv[0] if argv else ""
    if not os.path.basename(program).startswith("python"):
        return None
    found = program if "/" in program else shutil.which(program, path=path or os.defpath)
    return os.path.abspath(found) if found else None


def _same_environment(a: str, b: str) -> bool:
    # A virtual environment's python links to its base one: the folder, not the file it
    # resolves to, says which environment (bin/python and bin/python3 are the same one).
    return os.path.dirname(os.path.abspath(a)) == os.path.dirname(os.path.abspath(b))


def _have(module: str) -> bool:
    """Whether this process's Python has ``module`` installed (found, not imported). The
    working directory does not count: a script's own modules sit beside it, not in a Python."""
    here = {"", os.getcwd()}
    try:
        return PathFinder.find_spec(module, [p for p in sys.path if p not in here]) is not None
    except (ImportError, ValueError):
        return False
