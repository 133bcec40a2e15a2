"""No ``torch.distributed`` in the engine, the collectives or the codecs: they reach the wire
through :mod:`ringtrain.transport` (issues 24 and 42).

import-linter cannot say this (it refuses subpackages of external packages as forbidden
modules, so ``torch.distributed`` cannot be named in pyproject.toml), so this test reads the
imports of every module of ``ringtrain.engine``, ``ringtrain.collectives`` and
``ringtrain.compression``: none may import it (Horovod's collectives call
:mod:`ringtrain.transport.group_ops`). The codecs with rounds of their own (PowerSGD, top-k) run them on the
:class:`ringtrain.compression.codec.Rounds` the engine hands them
(:func:`ringtrain.transport.rounds`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import ringtrain

ROOT = Path(ringtrain.__file__).parent


# torch.distributed itself, and ringtrain.compat, which wraps some of its calls.
_DOORS = ("torch.distributed", "ringtrain.compat")


def _imports_distributed(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            return True  # torch.distributed.all_reduce(...) after a plain ``import torch``
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n == d or n.startswith(d + ".") for n in names for d in _DOORS):
            return True
    return False


def test_engine_collectives_and_codecs_reach_the_wire_only_through_the_transport() -> None:
    found = {
        str(p.relative_to(ROOT))
        for package in ("engine", "collectives", "compression")
        for p in sorted((ROOT / package).rglob("*.py"))
        if _imports_distributed(p)
    }
    assert found == set(), f"torch.distributed imported by: {sorted(found)}"
