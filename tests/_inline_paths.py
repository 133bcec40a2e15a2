"""Run a rank function on both paths of a small collective: inline in the negotiation round, or
as a Gloo collective of its own (the inline path switched off on every rank)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

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
