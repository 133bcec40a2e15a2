"""The environment table (ringtrain.environ) is the only place that names a variable or touches
``os.environ``: everything else in src/ takes a mapping and the table's names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ringtrain import environ
from ringtrain.config import Config
from ringtrain.errors import ConfigError

SRC = Path(environ.__file__).parent
TABLE = Path(environ.__file__)
GROUPS = (
    environ.Ringtrain,
    environ.Horovod,
    environ.Torch,
    environ.OpenMPI,
    environ.MPICH,
    environ.Slurm,
    environ.Kubeflow,
    environ.KubeflowTrainer,
    environ.Ray,
    environ.Threads,
    environ.Process,
)
NAMES = {v for g in GROUPS for k, v in vars(g).items() if not k.startswith("_")}
NAMES |= set(environ.HOROVOD_VARS) | {p for p in environ.HOROVOD_UNUSED if "*" not in p}


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p != TABLE)


def _not_names(tree: ast.AST) -> set[int]:
    """ids of strings that are not variable names: docstrings (they may name variables for the
    reader) and argparse metavars (``metavar="PATH"``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "metavar":
            out.add(id(node.value))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def test_only_the_table_touches_os_environ() -> None:
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and node.attr in ("environ", "getenv", "putenv", "unsetenv", "environb")
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} os.{node.attr}")
    assert not found, "use ringtrain.environ instead:\n" + "\n".join(found)


def test_every_variable_is_named_once() -> None:
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        docs = _not_names(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in NAMES
                and id(node) not in docs
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.value!r}")
    assert not found, "name these through ringtrain.environ:\n" + "\n".join(found)


def test_names_are_unique_and_placement_is_not_a_setting() -> None:
    values = [v for g in GROUPS for k, v in vars(g).items() if not k.startswith("_")]
    assert len(values) == len(set(values))
    assert environ.Ringtrain.RANK in environ.PLACEMENT_VARS
    assert all(v.startswith(environ.PREFIX) for v in environ.PLACEMENT_VARS)


def test_writes_go_through_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RINGTRAIN_TEST_ENVIRON", raising=False)
    environ.setdefault("RINGTRAIN_TEST_ENVIRON", "a")
    environ.setdefault("RINGTRAIN_TEST_ENVIRON", "b")  # the first value (the user's) wins
    assert environ.current()["RINGTRAIN_TEST_ENVIRON"] == "a"
    environ.pop("RINGTRAIN_TEST_ENVIRON")
    assert "RINGTRAIN_TEST_ENVIRON" not in environ.current()


def test_every_horovod_variable_without_meaning_is_reported() -> None:
    # A name both in HOROVOD_UNUSED and matched by HOROVOD_PLACEMENT would pass silently.
    for pattern, why in environ.HOROVOD_UNUSED.items():
        var = pattern.replace("*", "X")
        assert environ.horovod_unused({var: "1"}) == [(var, why)], var


def test_horovod_gloo_timeout_is_the_timeout_and_placement_stays_silent() -> None:
    # Horovod bounds every Gloo rendezvous and operation by it, as timeout_s does here.
    env = {
        "HOROVOD_GLOO_TIMEOUT_SECONDS": "45",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "5000",
        "HOROVOD_GLOO_IFACE": "lo",
    }
    assert environ.horovod_settings(env) == {"timeout_s": 45, "network_interface": "lo"}
    assert Config.from_env(env).timeout_s == 45
    assert environ.horovod_unused(env) == []
    new = {"HOROVOD_GLOO_SOMETHING_NEW": "1"}
    assert environ.horovod_unused(new) == [("HOROVOD_GLOO_SOMETHING_NEW", "not known to ringtrain")]
    with pytest.raises(ConfigError, match=r"an integer of seconds, > 0"):
        environ.horovod_settings({"HOROVOD_GLOO_TIMEOUT_SECONDS": "0"})
