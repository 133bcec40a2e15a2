"""The tests' helper modules have names of their own.

pytest puts each test directory on ``sys.path``, and the tests import their helpers by bare
name (``from _repeats import ...``), so two helpers of one name in different directories make
one test import the other's: which one depends on the order the suite collects in. The full
suite then fails where a single directory passes (tests/_launched.py against
tests/cluster/_launched.py did exactly that).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).parent


def test_helper_module_names_are_unique() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" in path.parts or path.name in ("conftest.py", "__init__.py"):
            continue
        if (path.parent / "__init__.py").exists():
            continue  # a package's modules are imported by their dotted name
        where[path.stem].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not clashes, f"helper modules sharing a name (rename one): {clashes}"
