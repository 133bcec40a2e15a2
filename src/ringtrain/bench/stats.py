"""Summaries of repeated timings: median and spread, never a lone mean.

A benchmark on a shared machine sees noise from everything else running on it; the median resists
it and the spread (min/max and the interquartile range) shows how much of it there was, so a
reader can tell a real difference from a lucky run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Summary:
    """Median and spread of ``n`` samples (seconds, or whatever unit the samples are in)."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        if not samples:
            raise ValueError("cannot summarize zero samples")
        xs = sorted(samples)
        if len(xs) >= 2:
            q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        else:
            q1 = q3 = xs[0]
        return cls(statistics.median(xs), xs[0], xs[-1], q1, q3, len(xs))

    @property
    def spread(self) -> float:
        """Relative interquartile range: (q3 - q1) / median."""
        return (self.q3 - self.q1) / self.median if self.median else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes/s each rank's link carries in a ring allreduce of ``nbytes``: 2(n-1)/n * bytes/t.

    This is the figure to compare with a link's rate (as in nccl-tests); it is 0 for one rank,
    where an allreduce moves nothing.
    """
    if seconds <= 0:
        return 0.0
    return 2.0 * (world_size - 1) / world_size * nbytes / seconds


def machine_info() -> dict[str, Any]:
    """What a reader needs to compare two result files: versions, backend, cores, threads."""
    import os
    import platform

    import torch
    import torch.distributed as dist

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "threads_per_rank": torch.get_num_threads(),
        # Other work on the machine skews every figure; the 1-minute load average before and
        # after the run (load_after) says how busy it was.
        "load_before": round(os.getloadavg()[0], 2),
    }


def load_average() -> float:
    import os

    return round(os.getloadavg()[0], 2)
