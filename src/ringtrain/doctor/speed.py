"""Hosts of unequal speed: what ``batch_shares`` would gain for the planned job.

The doctor's allreduce job times every rank's compute at once (``compute_gflops``: fp32 matrix
multiplies for a moment, on the threads the launcher gave it; one rank per host, or 2 ranks on
one host). A host's rate is the sum of its ranks' there. The planned job's ranks share their
host's cores (as :mod:`.placement` assumes), so each gets ``host rate / ranks on it``; at equal
shares a step's compute takes the slowest rank's time, in proportion to the rates every rank's
is the same (:func:`ringtrain.diagnostics.shares.from_rates`). Matrix multiplies stand for the
model's compute: a host that is faster at them is taken to be faster at training by as much.

Pure: the allreduce section and the placement in, a section and a line out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.diagnostics import shares

# Below this gain the ranks count as even in speed (the probe's own spread is a few percent).
EVEN_GAIN = 1.05


def host_rates(rank_hosts: Sequence[str], gflops: Sequence[float]) -> dict[str, float]:
    """Each host's measured rate (GFLOP/s): the sum of its ranks', in the order first seen."""
    if len(rank_hosts) != len(gflops):
        raise ValueError(f"{len(gflops)} rates for {len(rank_hosts)} ranks")
    out: dict[str, float] = {}
    for host, rate in zip(rank_hosts, gflops):
        out[host] = out.get(host, 0.0) + float(rate)
    return out


def rank_rates(hosts: Mapping[str, float], counts: Mapping[str, int]) -> list[float] | None:
    """The planned ranks' rates, in rank order (hosts filled in order, ``counts`` ranks each):
    ``host rate / ranks on it``. None when a planned host was not measured."""
    out: list[float] = []
    for host, n in counts.items():
        if n <= 0:
            continue
        if host not in hosts or not hosts[host] > 0:
            return None
        out += [hosts[host] / n] * n
    return out


def examine(allreduce: Mapping[str, Any], counts: Mapping[str, int] | None) -> dict[str, Any]:
    """The ``compute`` section of the doctor's document: host and rank rates, the predicted
    gain of shares by speed and its line; ``skipped`` says why when there is none."""
    gflops = allreduce.get("compute_gflops")
    rank_hosts = allreduce.get("rank_hosts")
    if not gflops or not rank_hosts or len(gflops) != len(rank_hosts):
        return {"skipped": "no compute measurement (the allreduce job did not run)"}
    if not counts:
        return {"skipped": "no placement"}
    hosts = host_rates(rank_hosts, gflops)
    ranks = rank_rates(hosts, counts)
    if ranks is None:
        return {"skipped": "a planned host's compute was not measured", "host_gflops": hosts}
    gain = shares.from_rates(ranks)
    return {
        "skipped": None,
        "host_gflops": hosts,
        "rank_gflops": ranks,
        "shares": list(gain.shares),
        "gain": gain.gain,
        "compute_vs_equal": 1 / gain.gain,
        "line": gain.relative_line()
        if gain.gain >= EVEN_GAIN
        else f"ranks even in speed: shares by speed {list(gain.shares)} would gain "
        f"{gain.gain:.2f}x samples/s (under {EVEN_GAIN:.2f}x); equal shares, the default, fit",
    }


def render(section: Mapping[str, Any] | None) -> list[str]:
    """The report's lines for the section (none when absent)."""
    if not section:
        return []
    if section.get("skipped"):
        return [f"Compute: skipped ({section['skipped']})"]
    hosts = ", ".join(f"{h} {r:.1f}" for h, r in section["host_gflops"].items())
    return [
        f"Compute (fp32 matrix multiply, GFLOP/s per host): {hosts}",
        f"  {section['line']}",
    ]
