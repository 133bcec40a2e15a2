"""How the probe answers the doctor: one marked JSON line per result on stdout.

The probe runs over ssh, where a login shell may print banners or warnings of its own; only
lines that start with :data:`MARKER` are results, so nothing else can be mistaken for one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import IO, Any

MARKER = "RINGTRAIN_PROBE "
PROBE_MODULE = "ringtrain.doctor.probe"


def emit(out: IO[str], record: dict[str, Any]) -> None:
    out.write(MARKER + json.dumps(record, sort_keys=True) + "\n")
    out.flush()


def records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The results among ``lines`` (text that is not a result is skipped)."""
    out = []
    for line in lines:
        line = line.strip()
        if not line.startswith(MARKER.strip()):
            continue
        try:
            value = json.loads(line[len(MARKER.strip()) :])
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"64K,1M,8M"`` -> bytes (K, M, G are powers of 1024; ``KiB``/``KB`` also read)."""
    units = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(?:i?b)?\s*", part.lower())
        if not m or int(m.group(1)) * units[m.group(2)] < 4:
            raise ValueError(f"bad size {part.strip()!r} in {text!r}; expected e.g. 64K,1M,8M")
        out.append(int(m.group(1)) * units[m.group(2)])
    return tuple(out)
