"""Hosts of unequal speed: what ``batch_shares`` would gain for the planned job.

The doctor's allreduce job times every rank's compute at once (``compute_gflops``: fp32 matrix
multiplies for a moment, on the threads the launcher gave it; one rank per host, or 2 ranks on
one host). A host's rate is the sum of its ranks' there. The planned job's ranks share their
host's cores (as :mod:`.placement` assumes), so each gets ``host rate / ranks on it``; at equal
shares a step's compute takes the slowest rank's time, in proportion to the rates every rank's
is the same (:func:`ringtrain.diagnostics.shares.from_rates`). Matrix multiplies stand for the
model's compute: a host that is faster at them is taken to be faster at training by as much.

Every rank takes several short probes at once (:data:`ringtrain.doctor.probe.COMPUTE_PROBES`); a
host's rate is the median of its probes (each the sum of its ranks' at that probe), and the
probes' range is the measurement's own spread. Shares by speed are recommended only where the
planned ranks differ by more than that: every probe of the fastest rank's host (per rank) above
every probe of the slowest's. Overlapping ranges mean even within the measurement's noise (two
identical hosts sharing cores read 73.5 and 86.9 GFLOP/s from one probe each, and were offered
shares for "1.09x"); a single probe per host (an older document) leaves the spread unknown, and
the line says so.

Pure: the allreduce section and the placement in, a section and a line out.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.diagnostics import shares

# Below this gain the ranks count as even in speed (the probe's own spread is a few percent).
EVEN_GAIN = 1.05
# Fewer probes per host than this leave the spread unknown.
MIN_PROBES = 3


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


def host_samples(
    rank_hosts: Sequence[str], samples: Sequence[Sequence[float]]
) -> dict[str, list[float]]:
    """Each host's probes (GFLOP/s): probe j is the sum of its ranks' probe j (taken at once),
    over as many probes as every rank has."""
    if len(rank_hosts) != len(samples):
        raise ValueError(f"{len(samples)} rates for {len(rank_hosts)} ranks")
    k = min((len(s) for s in samples), default=0)
    out: dict[str, list[float]] = {}
    for host, probes in zip(rank_hosts, samples):
        mine = out.setdefault(host, [0.0] * k)
        for j in range(k):
            mine[j] += float(probes[j])
    return out


def certainty(per_rank: Mapping[str, Sequence[float]]) -> tuple[bool | None, str]:
    """Whether the planned ranks' difference in speed is more than the probes' spread:
    ``per_rank`` maps each planned host to its probes per rank. True when every probe of the
    fastest host (by median) is above every probe of the slowest, False when they overlap,
    None when there are too few probes to say; and the sentence that says so."""
    if len(per_rank) < 2:
        return None, "one host: none to compare"
    k = min(len(v) for v in per_rank.values())
    if k < MIN_PROBES:
        return None, "unsure: one probe per host, its spread not measured"
    order = sorted(per_rank, key=lambda h: statistics.median(per_rank[h]))
    slow, fast = order[0], order[-1]

    def span(h: str) -> str:
        return f"{h} {min(per_rank[h]):.1f}-{max(per_rank[h]):.1f}"

    if min(per_rank[fast]) > max(per_rank[slow]):
        return True, (
            f"sure: each of {k} probes per rank was faster on {fast} than any on {slow} "
            f"(GFLOP/s per rank: {span(fast)}, {span(slow)})"
        )
    return False, (
        f"the probes' spread is as large as the difference: {k} probes per rank overlap "
        f"(GFLOP/s per rank: {span(fast)}, {span(slow)})"
    )


def examine(allreduce: Mapping[str, Any], counts: Mapping[str, int] | None) -> dict[str, Any]:
    """The ``compute`` section of the doctor's document: host and rank rates (medians), the
    probes' range, the predicted gain of shares by speed and its line, and how sure it is
    (:func:`certainty`); ``skipped`` says why when there is none."""
    gflops = allreduce.get("compute_gflops")
    rank_hosts = allreduce.get("rank_hosts")
    if not gflops or not rank_hosts or len(gflops) != len(rank_hosts):
        return {"skipped": "no compute measurement (the allreduce job did not run)"}
    if not counts:
        return {"skipped": "no placement"}
    samples = allreduce.get("compute_samples")
    if not samples or len(samples) != len(gflops) or not all(samples):
        samples = [[g] for g in gflops]  # one probe per rank: the spread is unknown
    probes = host_samples(rank_hosts, samples)
    hosts = {h: statistics.median(v) for h, v in probes.items()}
    ranks = rank_rates(hosts, counts)
    if ranks is None:
        return {"skipped": "a planned host's compute was not measured", "host_gflops": hosts}
    # The planned ranks share their host's rate: compare them per rank, as the gain does.
    sure, why = certainty({h: [v / n for v in probes[h]] for h, n in counts.items() if n > 0})
    gain = shares.from_rates(ranks)
    if gain.gain < EVEN_GAIN:
        line = (
            f"ranks even in speed: shares by speed {list(gain.shares)} would gain "
            f"{gain.gain:.2f}x samples/s (under {EVEN_GAIN:.2f}x); equal shares, the default, "
            f"fit ({why})"
        )
    elif sure is False:
        line = (
            f"ranks even in speed within the measurement's noise: shares by speed "
            f"{list(gain.shares)} would gain {gain.gain:.2f}x samples/s by the medians, but "
            f"{why}; equal shares, the default, fit (batch_shares='auto' measures the job itself)"
        )
    else:
        line = f"{gain.relative_line()} ({why})"
    return {
        "skipped": None,
        "host_gflops": hosts,
        "host_range": {h: [min(v), max(v)] for h, v in probes.items()},
        "probes": min(len(v) for v in probes.values()),
        "sure": sure,
        "rank_gflops": ranks,
        "shares": list(gain.shares),
        "gain": gain.gain,
        "compute_vs_equal": 1 / gain.gain,
        "line": line,
    }


def render(section: Mapping[str, Any] | None) -> list[str]:
    """The report's lines for the section (none when absent)."""
    if not section:
        return []
    if section.get("skipped"):
        return [f"Compute: skipped ({section['skipped']})"]
    k = section.get("probes", 1)
    ranges = section.get("host_range") or {}
    if k >= MIN_PROBES and ranges:
        head = f"GFLOP/s per host, median [range] of {k} probes"
        hosts = ", ".join(
            f"{h} {r:.1f} [{ranges[h][0]:.1f}-{ranges[h][1]:.1f}]"
            for h, r in section["host_gflops"].items()
        )
    else:
        head = "GFLOP/s per host"
        hosts = ", ".join(f"{h} {r:.1f}" for h, r in section["host_gflops"].items())
    return [
        f"Compute (fp32 matrix multiply, {head}): {hosts}",
        f"  {section['line']}",
    ]
