"""The settings every rank's DistributedOptimizer must share, checked at the learning step.

The gradient exchange is not negotiated (that is what makes it as fast as DDP's), so ranks whose
optimizers were built differently would not fail: with ``op=Average`` on one rank and ``Sum`` on
another, each rank scaled its own part before the sum and every rank stepped with ``g0/2 + g1``;
a codec or a bucket size on one rank only made Gloo abort (SIGABRT) or hang. Horovod's
coordinator refuses such ops by name ("Mismatched reduction operation").

So the learning step's first collective (the parameter count, :func:`ringtrain.engine.schedule.
gather`) carries a digest of these settings too; where the digests differ, the ranks gather the
settings themselves and every rank raises the same :class:`ConfigError`, naming each setting
that differs and each rank's value, before anything is sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from ringtrain.errors import ConfigError
from ringtrain.transport import group_ops

# The settings' text a rank contributes when digests differ (more is cut, never needed).
TEXT_BYTES = 4096


def digest(settings: Mapping[str, str]) -> int:
    """A 56-bit digest of ``settings``: fits an int64, alike on every rank for the same text."""
    text = json.dumps(dict(settings), sort_keys=True).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


def raise_differences(settings: Mapping[str, str], group: Any, size: int) -> None:
    """Every rank's settings, gathered on ``group`` (all ranks call it: their digests
    differed), and a ConfigError naming what differs."""
    text = json.dumps(dict(settings), sort_keys=True).encode()[:TEXT_BYTES]
    mine = torch.zeros(TEXT_BYTES, dtype=torch.uint8)
    mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    gathered = torch.empty(size * TEXT_BYTES, dtype=torch.uint8)
    group_ops.all_gather_into(gathered, mine, group)
    ranks = [_decode(row) for row in gathered.view(size, TEXT_BYTES)]
    raise ConfigError(describe(ranks))


def describe(ranks: list[dict[str, str]]) -> str:
    """The error for ranks whose settings differ: one line per setting, each rank's value."""
    names = sorted({k for r in ranks for k in r if len({s.get(k) for s in ranks}) > 1})
    lines = ["the DistributedOptimizer's settings differ between ranks:"]
    for name in names:
        values = ", ".join(f"rank {i} {r.get(name, '(unset)')!s}" for i, r in enumerate(ranks))
        lines.append(f"  {name}: {values}")
    lines.append(
        "HINT: every rank must build the optimizer with the same arguments and the same "
        "RINGTRAIN_* settings (a variable set on one host only?)."
    )
    return "\n".join(lines)


def _decode(row: torch.Tensor) -> dict[str, str]:
    raw = bytes(row.tolist()).rstrip(b"\0")
    try:
        return {str(k): str(v) for k, v in json.loads(raw).items()}
    except ValueError:  # cut at TEXT_BYTES: say so rather than fail to say anything
        return {"(settings)": "too long to compare"}
