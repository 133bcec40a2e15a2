"""Helpers for the tests of repeated collectives (collectives.resubmit, the fast lane's
repeats): the calls that differ from a reserved or cached allreduce by one argument, and a
count of the requests a rank builds."""

from __future__ import annotations

from typing import Any

import torch

from ringtrain.collectives import async_ops
from ringtrain.collectives.requests import Request


def differing_calls(t: torch.Tensor) -> list[tuple[str, torch.Tensor, str, float, float]]:
    """Calls that differ by one argument from an allreduce of ``t`` (float32 [64, 64]) named
    "w" with op Average, prescale 1 and postscale 2: each must build a request of its own."""
    return [
        ("v", t, "Average", 1.0, 2.0),  # name
        ("w", torch.zeros(64, 32), "Average", 1.0, 2.0),  # shape
        ("w", torch.zeros(4096), "Average", 1.0, 2.0),  # same count, other shape
        ("w", t.double(), "Average", 1.0, 2.0),  # dtype
        ("w", t, "Sum", 1.0, 2.0),  # op
        ("w", t, "Average", 0.5, 2.0),  # prescale
        ("w", t, "Average", 1.0, 1.0),  # postscale
        ("w", t.to_sparse(), "Average", 1.0, 2.0),  # a sparse tensor: its own error
        ("w", t.to("meta"), "Average", 1.0, 2.0),  # not on the CPU
    ]


def counting(count: list[int]) -> Any:
    """async_ops.Request, counting the requests built in ``count[0]`` (a patch the caller
    takes back: the test world is shared with other tests)."""
    real = async_ops.Request

    def counted(*args: Any, **kwargs: Any) -> Request:
        count[0] += 1
        return real(*args, **kwargs)

    return counted


N = 4096  # 16 KiB of float32: above what travels inline, so the lane may take it


def data(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor at ``step``, the same in every process."""
    return torch.randn(N, generator=torch.Generator().manual_seed(1000 * step + rank)) * 100


def check_spellings(results: list[dict[str, Any]], step: int) -> None:
    """Every rank's ``inplace`` (an ``allreduce_`` Sum: its own tensor back, holding the sum)
    and ``plain`` (an ``allreduce`` Average: the input untouched) at ``step``, bit for bit alike
    on every rank."""
    size = len(results)
    total = sum(data(step, k) for k in range(size))
    for got in results:
        same, inplace = got["inplace"][step]
        assert same and torch.equal(inplace, results[0]["inplace"][step][1])
        torch.testing.assert_close(inplace, total, rtol=1e-5, atol=1e-4)
        untouched, plain = got["plain"][step]
        assert untouched and torch.equal(plain, results[0]["plain"][step][1])
        torch.testing.assert_close(plain, total / size, rtol=1e-5, atol=1e-4)
