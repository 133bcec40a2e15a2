"""The engine's shape (issue 24): small modules, small classes, a thin DistributedOptimizer.

Read from the source, like the import contracts: a class that grows past 20 attributes, or a
module past 600 lines, fails here and asks to be split where its concerns part."""

from __future__ import annotations

import ast
from pathlib import Path

import ringtrain

ENGINE = Path(ringtrain.__file__).parent / "engine"
MAX_ATTRIBUTES = 20
MAX_MODULE_LINES = 600
MAX_OPTIMIZER_LINES = 400


def _attributes(cls: ast.ClassDef) -> set[str]:
    """Names assigned as ``self.<name>`` anywhere in the class."""
    found: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    found.add(t.attr)
    return found


def test_no_engine_class_holds_more_than_20_attributes() -> None:
    big = {}
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = len(_attributes(node))
                if n > MAX_ATTRIBUTES:
                    big[f"{path.relative_to(ENGINE)}:{node.name}"] = n
    assert big == {}


def test_engine_modules_stay_small_and_the_optimizer_thin() -> None:
    lines = {
        str(p.relative_to(ENGINE)): len(p.read_text().splitlines())
        for p in sorted(ENGINE.rglob("*.py"))
    }
    assert {k: n for k, n in lines.items() if n >= MAX_MODULE_LINES} == {}
    assert lines["optimizer.py"] <= MAX_OPTIMIZER_LINES
