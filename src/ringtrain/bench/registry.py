"""The benchmark registry: a benchmark is a function from its parameters to a result object.

Benchmarks return numbers rather than print them, so the CLI, the tests and anyone scripting a
sweep use the same code; printing, JSON and plots are the CLI's business (:mod:`.report`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

BENCHMARKS: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[F], F]:
    """Register ``fn(params) -> result`` under ``name`` (the ``ringtrain bench NAME`` command)."""

    def deco(fn: F) -> F:
        if name in BENCHMARKS and BENCHMARKS[name] is not fn:
            raise ValueError(f"benchmark {name!r} is registered twice")
        BENCHMARKS[name] = fn
        return fn

    return deco
