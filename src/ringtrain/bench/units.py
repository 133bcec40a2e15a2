"""Byte sizes as the bench command line writes and reads them: ``64K``, ``4MiB``, ``4K..64M``.

No torch here: ``ringtrain bench`` parses (and refuses bad sizes) before importing it.
"""

from __future__ import annotations

import re

from ringtrain.errors import ConfigError

KiB = 1024
MiB = 1024 * 1024

_UNITS = {"": 1, "b": 1, "k": KiB, "kib": KiB, "m": MiB, "mib": MiB, "g": 1 << 30, "gib": 1 << 30}


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def parse_bytes(text: str) -> int:
    """``64K``, ``4MiB``, ``1048576`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(
            f"cannot read {text!r} as a size.\nHINT: write e.g. 4096, 64K, 64KiB, 16M or 1G."
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_sizes(text: str) -> tuple[int, ...]:
    """``4K,64K,1M`` (a list) or ``4K..64M`` (x4 steps) or ``4K..64M:2`` (x2 steps)."""
    if ".." not in text:
        sizes = [parse_bytes(s) for s in text.split(",") if s.strip()]
    else:
        span, _, factor_s = text.partition(":")
        lo_s, _, hi_s = span.partition("..")
        lo, hi = parse_bytes(lo_s), parse_bytes(hi_s)
        try:
            factor = int(factor_s or 4)
        except ValueError:
            factor = 0  # refused below, with the range's HINT
        if lo < 1 or hi < lo or factor < 2:
            raise ConfigError(
                f"bad size range {text!r}: need 1 <= low <= high and a factor >= 2.\n"
                "HINT: e.g. --sizes 4K..64M or --sizes 4K..64M:2."
            )
        sizes = []
        s = lo
        while s <= hi:
            sizes.append(s)
            s *= factor
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes {text!r} gives no positive sizes")
    return tuple(sizes)
