"""What the launcher's report says to do about a rank that could not import a module or open its
script: which Python the rank ran and which has the module, a Horovod import, a missing file.

The pure part with tails as agents relay them; then real ``ringtrain run`` jobs whose ranks fail
the way a new user's do (``python`` on PATH is not the environment with ringtrain, an unchanged
Horovod script, a mistyped script path). Ranks here import nothing heavy: each job takes about
a second.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringtrain.launch import exit_hints
from ringtrain.launch.failures import exit_failure, report


def _traceback(last: str) -> list[str]:
    return ["Traceback (most recent call last):", '  File "train.py", line 1, in <module>', last]


def _python_on_path(tmp_path: Path) -> Path:
    """A folder whose ``python`` is this interpreter without site-packages or PYTHONPATH:
    another environment, as a base Python beside a virtual environment is."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    python.chmod(0o755)
    return bin_dir


def test_a_python_on_path_without_the_module_is_named_beside_the_one_that_has_it(
    tmp_path: Path,
) -> None:
    bin_dir = _python_on_path(tmp_path)
    tail = _traceback("ModuleNotFoundError: No module named 'ringtrain'")
    [hint] = exit_hints.for_exit(tail, ["python", "train.py"], str(bin_dir))
    assert hint.startswith(
        f"HINT: the rank ran {bin_dir / 'python'} (its command's 'python'), which has no "
        f"'ringtrain'; the Python ringtrain runs in on that host has it: {sys.executable}."
    )
    assert f"ringtrain run ... -- {sys.executable} ..." in hint
    # A submodule's name is looked up by its package.
    tail = _traceback("ModuleNotFoundError: No module named 'ringtrain.torch'")
    assert "which has no 'ringtrain'" in exit_hints.for_exit(tail, ["python"], str(bin_dir))[0]


def test_a_module_missing_from_the_launchers_own_python_too_is_to_be_installed() -> None:
    tail = _traceback("ModuleNotFoundError: No module named 'no_such_module_xyz'")
    [hint] = exit_hints.for_exit(tail, [sys.executable, "train.py"], None)
    assert hint.startswith(
        f"HINT: install the package that provides 'no_such_module_xyz' into {sys.executable} "
        "on that host"
    )
    # The same environment by another name (python3 beside python) is not another Python.
    python3 = os.path.join(os.path.dirname(sys.executable), "python3")
    tail = _traceback("ModuleNotFoundError: No module named 'ringtrain'")
    assert "HINT: install the package" in exit_hints.for_exit(tail, [python3], None)[0]
    # A command that is not an interpreter: its Python is not for the agent to guess.
    [hint] = exit_hints.for_exit(tail, ["./train.sh"], None)
    assert hint.startswith("HINT: install the package that provides 'ringtrain' into the rank's")


def test_a_module_beside_the_script_is_not_said_to_be_in_the_launchers_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_model_xyz.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    bin_dir = _python_on_path(tmp_path)
    tail = _traceback("ModuleNotFoundError: No module named 'my_model_xyz'")
    [hint] = exit_hints.for_exit(tail, ["python"], str(bin_dir))
    assert "for a module of your own, set PYTHONPATH" in hint
    assert sys.executable not in hint


def test_a_horovod_import_and_a_missing_script_have_their_own_hints() -> None:
    tail = _traceback("ModuleNotFoundError: No module named 'horovod'")
    [hint] = exit_hints.for_exit(tail, ["python"], None)
    assert "import ringtrain.torch as hvd (was: import horovod.torch as hvd)" in hint
    tail = ["python: can't open file '/data/train.py': [Errno 2] No such file or directory"]
    [hint] = exit_hints.for_exit(tail, ["python", "/data/train.py"], None)
    assert hint.startswith("HINT: that host has no file /data/train.py.")
    assert "copies no files" in hint
    # Only the last lines count: an import handled early on is not why the rank failed.
    tail = [*_traceback("ModuleNotFoundError: No module named 'yaml'"), *["..."] * 5]
    assert exit_hints.for_exit(tail, ["python"], None) == []
    assert exit_hints.for_exit(_traceback("ValueError: bad"), ["python"], None) == []


def test_the_report_puts_the_root_causes_hint_after_its_last_words() -> None:
    tail = _traceback("ModuleNotFoundError: No module named 'horovod'")
    msg = {"rank": 0, "code": 1, "signal": None, "tail": tail, "at": 1.0, "hint": ["HINT: h0"]}
    cause = exit_failure("a", msg, 10, 0.1)
    other = exit_failure("a", {**msg, "rank": 1, "at": 2.0, "hint": ["HINT: h1"]}, 11, 0.2)
    lines = report([cause, other]).splitlines()
    assert lines[lines.index(f"  | {tail[-1]}") + 1] == "HINT: h0"
    assert "HINT: h1" not in lines  # the others' are alike, or not the cause
    # An agent of an older release sends no hint.
    del msg["hint"]
    assert exit_failure("a", msg, 10, 0.1).hint == []


def _run(tmp_path: Path, *command: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "-np", "2", "--", *command],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )


def test_a_job_run_with_another_python_says_which_python_has_ringtrain(tmp_path: Path) -> None:
    bin_dir = _python_on_path(tmp_path)
    proc = _run(tmp_path, "python", "-c", "import ringtrain.torch", path=str(bin_dir))
    assert proc.returncode == 1, proc.stderr
    assert (
        f"  | ModuleNotFoundError: No module named 'ringtrain'\nHINT: the rank ran "
        f"{bin_dir / 'python'} (its command's 'python'), which has no 'ringtrain'; the Python "
        f"ringtrain runs in on that host has it: {sys.executable}."
    ) in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("horovod") is not None, reason="horovod installed")
def test_a_job_that_imports_horovod_is_told_the_one_line_to_change(tmp_path: Path) -> None:
    proc = _run(tmp_path, sys.executable, "-c", "import horovod.torch as hvd")
    assert proc.returncode == 1, proc.stderr
    assert "HINT: ringtrain runs Horovod scripts after one change" in proc.stderr


def test_a_job_whose_script_is_not_there_is_told_no_file_is_copied(tmp_path: Path) -> None:
    proc = _run(tmp_path, sys.executable, "no_such_train.py")
    assert proc.returncode == 2, proc.stderr
    assert f"HINT: that host has no file {tmp_path / 'no_such_train.py'}." in proc.stderr
