"""One ``[rankN]:`` prefix on an uncaught exception's traceback, however often the world forms.

``torch.distributed.init_process_group`` replaces ``sys.excepthook`` with one that calls the
hook it found and prefixes each line it prints with ``[rankN]: ``. ringtrain calls it again at
every elastic re-form (and at ``init()`` after ``shutdown()``), so the hooks would nest and the
prefixes pile up (``[rank0]: [rank1]: Traceback``), the inner ones naming ranks of worlds that
are gone. Around each call, :func:`once` takes torch's hook back out and keeps one of its own
that prints the same prefix with the rank of the world formed last. Hooks installed in between
(ringtrain's own, which posts the failure, or the script's) stay where they are.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], object]

_rank: int | None = None  # the rank of the world formed last: the prefix
_below: _Hook | None = None  # the hook the prefix is put on


def _prefixed(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """torch's prefix hook (distributed_c10d.py), the rank read when it prints."""
    hook = _below if _below is not None else sys.__excepthook__
    old_stderr = sys.stderr
    sys.stderr = buf = io.StringIO()
    try:
        hook(kind, exc, tb)
    finally:
        sys.stderr = old_stderr
    lines = buf.getvalue().split("\n")
    sys.stderr.write("\n".join(f"[rank{_rank}]: {s}" if s else "" for s in lines))
    sys.stderr.flush()


@contextmanager
def once(rank: int) -> Iterator[None]:
    """Around ``dist.init_process_group`` as ``rank``: one prefix hook, naming ``rank``."""
    global _rank, _below
    before = sys.excepthook
    try:
        yield
    finally:
        torch_hook, sys.excepthook = sys.excepthook, before
    if torch_hook is before:
        return  # a torch that adds no prefix: neither does ringtrain
    _rank = rank
    if _below is None:  # the first world: the prefix goes where torch put its own
        _below, sys.excepthook = before, _prefixed
