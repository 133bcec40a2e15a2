"""The size rules over all of src/ringtrain (issue 42), read from the source like the import
contracts: at most 20 attributes per class, counted by owner; modules under 600 lines;
functions under 80 lines (argument parsers excepted); no package's count of ``Any`` growing.

What is over a limit today is listed below with its size. The lists only shrink: an entry that
grows fails, and so does one that has come within the limit (remove it, so it stays there).
tests/engine/test_engine_structure.py keeps the engine itself to the limits with no exceptions.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import ringtrain

SRC = Path(ringtrain.__file__).parent
MAX_ATTRIBUTES = 20
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# Tables of settings: one typed field per option is their point (STYLE.md: configuration in one
# typed object), so their size follows the options, not a design choice.
SETTINGS_TABLES = {"config.py:Config", "launch/options.py:LaunchOptions"}
# Over the limits today (issue 42 item 4), with their size: split them where their concerns part.
ATTRIBUTES_OVER: dict[str, int] = {}
FUNCTIONS_OVER = {
    "bench/runner.py:_params": 92,
    "bench/train.py:bench_train": 84,
    "checkpoint/local_state.py:cut": 85,
    "doctor/advice.py:recommend": 84,
    "doctor/placement.py:check": 82,
    "engine/optimizer.py:__init__": 96,
    "launch/command.py:options_from_args": 81,
    "runtime/state.py:start": 94,
    "runtime/store_connect.py:connect": 104,
}
# Uses of ``typing.Any`` per thousand non-blank lines, per package (or top-level module): each
# a little above what was measured (issue 42), a ceiling, never a target. Lower one when a package
# sheds Anys; a package not listed may have at most ANY_PER_KLOC_NEW. Issue 42's aim is under 12
# in transport, checkpoint, ray and elastic.
ANY_PER_KLOC = {
    "__init__": 6.1, "__main__": 0, "bench": 16.6, "checkpoint": 12.0,
    "cli": 0, "collectives": 30.1, "compat": 167.2, "compression": 42.4, "config": 40.5,
    "deploy": 28.1, "diagnostics": 15.1, "doctor": 22.8, "elastic": 9.8, "engine": 26.3,
    "environ": 15.2, "errors": 0, "host": 12.3, "launch": 11.3, "lifecycle": 4.5, "ray": 5.7,
    "runtime": 4.4, "security": 12.6, "spark": 38.7, "testing": 13.2, "torch": 0,
    "transport": 7.0,  # typed at the seams (was 49.0; torch's ProcessGroup overrides keep opts: Any)
}  # fmt: skip
ANY_PER_KLOC_NEW = 12.0


def _modules() -> Iterator[tuple[str, ast.Module, int]]:
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        yield str(path.relative_to(SRC)), ast.parse(text), len(text.splitlines())


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Names assigned as ``self.<name>`` in the class, and fields its body declares."""
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
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self":
                    found.add(t.attr)
    for stmt in cls.body:  # dataclass fields and declarations a mixin makes for its owner
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found.add(stmt.target.id)
    return found


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases]


def attributes_by_owner() -> dict[str, int]:
    """Each class's instance attributes with those of its bases in src/ringtrain: a field a
    base or mixin declares or sets belongs to every object built from it (a class split across
    files by inheritance is still one object)."""
    classes: dict[str, tuple[str, ast.ClassDef]] = {}
    for rel, tree, _ in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, (rel, node))

    def gather(name: str, seen: frozenset[str]) -> set[str]:
        _, cls = classes[name]
        names = _self_attributes(cls)
        for base in _base_names(cls):
            if base in classes and base not in seen:
                names |= gather(base, seen | {name})
        return names

    return {f"{rel}:{name}": len(gather(name, frozenset())) for name, (rel, _) in classes.items()}


def _over(found: dict[str, int], allowed: dict[str, int], limit: int) -> list[str]:
    wrong = [
        f"{k}: {n} (limit {limit}{f', allowed {allowed[k]}' if k in allowed else ''})"
        for k, n in sorted(found.items())
        if n > limit and n > allowed.get(k, limit)
    ]
    wrong += [
        f"{k}: now {found.get(k, 0)}, within the limit or gone: remove it from the list"
        for k in sorted(allowed)
        if found.get(k, 0) <= limit
    ]
    return wrong


def test_no_class_holds_more_than_20_attributes_counted_by_owner() -> None:
    found = {k: n for k, n in attributes_by_owner().items() if k not in SETTINGS_TABLES}
    assert _over(found, ATTRIBUTES_OVER, MAX_ATTRIBUTES) == []


def test_launch_classes_hold_at_most_20_attributes_with_no_exception() -> None:
    """Issue 37 item 3: the supervisor (37 with its elastic base class) now owns its elastic
    host pool and job state; nothing in launch/ may be listed above again."""
    found = attributes_by_owner()
    assert found["launch/supervisor.py:Supervisor"] <= MAX_ATTRIBUTES
    assert {
        k: n
        for k, n in found.items()
        if k.startswith("launch/") and k not in SETTINGS_TABLES and n > MAX_ATTRIBUTES
    } == {}
    assert not [k for k in ATTRIBUTES_OVER if k.startswith("launch/")]


def test_modules_stay_under_600_lines() -> None:
    assert {rel: n for rel, _, n in _modules() if n >= MAX_MODULE_LINES} == {}


def _is_parser(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """An argument parser: a list of ``add_argument`` calls is long by nature and reads flat."""
    return any(
        isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"
        for n in ast.walk(fn)
    )


def test_functions_stay_under_80_lines() -> None:
    found: dict[str, int] = {}
    for rel, tree, _ in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_parser(node):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                found[f"{rel}:{node.name}"] = max(found.get(f"{rel}:{node.name}", 0), length)
    assert _over(found, FUNCTIONS_OVER, MAX_FUNCTION_LINES - 1) == []


def any_uses(tree: ast.AST) -> int:
    """Uses of ``Any`` in a syntax tree, as ``Any`` or ``typing.Any`` (the import is not one)."""
    return sum(
        getattr(node, "id", None) == "Any" or getattr(node, "attr", None) == "Any"
        for node in ast.walk(tree)
    )


def any_table() -> dict[str, tuple[int, int]]:
    """Per package or top-level module: (uses of ``Any``, non-blank lines)."""
    table: dict[str, tuple[int, int]] = {}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        package = str(path.relative_to(SRC)).split("/")[0].removesuffix(".py")
        uses, lines = table.get(package, (0, 0))
        nonblank = sum(1 for line in text.splitlines() if line.strip())
        table[package] = (uses + any_uses(ast.parse(text)), lines + nonblank)
    return table


def test_any_is_counted_in_the_syntax_tree() -> None:
    tree = ast.parse("from typing import Any\nimport typing\nx: Any = typing.Any  # Any\n")
    assert any_uses(tree) == 2  # the annotation and typing.Any: not the import, not a comment


def test_no_package_uses_any_more_densely_than_it_did() -> None:
    table = any_table()
    density = {p: 1000 * uses / lines for p, (uses, lines) in table.items() if lines}
    grown = {
        p: f"{d:.1f} per kloc (ceiling {ANY_PER_KLOC.get(p, ANY_PER_KLOC_NEW)})"
        for p, d in sorted(density.items())
        if d > ANY_PER_KLOC.get(p, ANY_PER_KLOC_NEW)
    }
    measured = ", ".join(f"{p} {d:.1f} ({table[p][0]}/{table[p][1]})" for p, d in density.items())
    assert grown == {}, (
        "type the new parameters (a Protocol in the lower package: ringtrain.runtime.contracts, "
        f"ringtrain.engine.stateful) instead of Any: {grown}\nmeasured (Any/lines): {measured}"
    )
