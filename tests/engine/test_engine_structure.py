"""The engine's shape (issue 24): small modules, small classes, a thin DistributedOptimizer.

Read from the source, like the import contracts: a class that grows past 20 attributes, or a
module past 600 lines, fails here and asks to be split where its concerns part."""

from __future__ import annotations

import ast
from pathlib import Path

import ringtrain
from test_source_shape import _self_attributes  # the one rule: self.<name> and fields

ENGINE = Path(ringtrain.__file__).parent / "engine"
MAX_ATTRIBUTES = 20
MAX_MODULE_LINES = 600
MAX_OPTIMIZER_LINES = 400


def test_no_engine_class_holds_more_than_20_attributes() -> None:
    big = {}
    for path in sorted(ENGINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = len(_self_attributes(node))
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


# The packages of the gradient path, from a ready bucket to updated parameters, and the
# checkpoint, which reads the path's state (its pieces were a second ``Piece``).
GRADIENT_PATH = ("engine", "compression", "transport", "collectives", "checkpoint")


def test_one_meaning_per_class_name_on_the_gradient_path() -> None:
    """No two classes of the gradient path share a name (there were two ``Scaling``s)."""
    where: dict[str, list[str]] = {}
    root = ENGINE.parent
    for package in GRADIENT_PATH:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(path.relative_to(root)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_lane_means_the_fast_lane_only() -> None:
    """ "lane" is the collectives' fast lane (collectives/lane.py). The engine's process groups
    are streams (engine/streams.py), a timeline's rows are tracks: no name in the engine, the
    codecs, the transport or the timeline says "lane"."""
    root = ENGINE.parent
    found = []
    for package in ("engine", "compression", "transport", "diagnostics"):
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Name):
                    names = [node.id]
                elif isinstance(node, ast.Attribute):
                    names = [node.attr]
                elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    names = [node.name]
                elif isinstance(node, ast.arg):
                    names = [node.arg]
                found += [f"{path.relative_to(root)}:{n}" for n in names if "lane" in n.lower()]
    assert found == []
