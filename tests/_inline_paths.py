"""Run a rank function on both paths of a small collective: inline in the negotiation round, or
as a Gloo collective of its own (the inline path switched off on every rank)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

import ringtrain as rt
from ringtrain.collectives import inline

PATHS = pytest.mark.parametrize("path", ["inline", "collective"])


def on(path: str, fn: Callable[[], None]) -> Callable[[], None]:
    if path == "inline":
        return fn

    @functools.wraps(fn)
    def run() -> None:
        saved, inline.INLINE_MAX_BYTES = inline.INLINE_MAX_BYTES, 0
        try:
            fn()
        finally:
            inline.INLINE_MAX_BYTES = saved

    return run


def inline_ops(op: Callable[[], Any]) -> tuple[Any, int]:
    """``op()``'s result, and how many collectives of the world set ran inline meanwhile."""
    executor = rt.global_process_set.communicator.service("controller")._executor
    before = executor.inline_ops
    result = op()
    return result, executor.inline_ops - before
