"""The straggler policy: from per-rank step timings, name the slowest rank and why it is slow.

Each rank measures, per optimizer step, how long it spent

    input      from the end of the previous step to the first forward call (data loading),
    compute    forward, backward and the optimizer update,
    wait       inside ``step()`` waiting for gradient communication that did not overlap,

and every N steps the numbers are gathered (with a short link probe: how fast each host's link
moves data) and passed here. Data-parallel ranks proceed in lock-step, so the job runs at the
pace of its slowest rank: a rank that is busy longer than the others makes *them* wait, and a
slow link makes everyone wait. The verdict is one of:

    compute   one rank's compute is well above the median (shared cores, thermal throttling)
    input     one rank's data loading is well above the median (slow disk, too few workers)
    shares    one rank is busy well above the median only because the shares of the global
              batch in force (``batch_shares``) give it more than its speed calls for
    network   a host's link is well below the others', or communication dominates every step
    none      ranks are balanced

With shares in force a rank's times are compared per sample (scaled to an equal share): a rank
given fewer samples is not fast for being done sooner, one given more is not slow for taking
longer. The shares are those the engine recorded over the window
(:data:`ringtrain.diagnostics.shares.IN_FORCE`) unless given.

This module is pure: numbers in, a report out; it is tested without processes or clocks.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ringtrain.diagnostics import shares

# A rank is a straggler when it is this much busier than the median rank...
SLOW_FACTOR = 1.25
# ...and the excess is at least this fraction of a step (ignores noise on tiny steps).
MIN_EXCESS = 0.05
# A link is slow when it moves data at less than this fraction of the median link.
SLOW_LINK_FACTOR = 0.5
# Communication that is not hidden behind compute dominates above this fraction of a step.
COMM_BOUND = 0.5
# Link rates within this factor of the slowest count as equally slow.
LINK_TIE = 1.1


@dataclass(frozen=True)
class RankTimes:
    """Mean seconds per step of one rank over the report window (per round where the ranks
    take different inner steps a round: ``analyse(per="round")``)."""

    rank: int
    host: str
    input_s: float
    compute_s: float
    wait_s: float

    @property
    def busy_s(self) -> float:
        return self.input_s + self.compute_s

    @property
    def step_s(self) -> float:
        return self.input_s + self.compute_s + self.wait_s


@dataclass(frozen=True)
class StragglerReport:
    kind: str  # "compute" | "input" | "network" | "none"
    ranks: tuple[int, ...]  # the ranks blamed (all ranks of a host for a slow link)
    hosts: tuple[str, ...]
    step_s: float
    detail: str
    per_rank: tuple[RankTimes, ...]
    link_mb_s: Mapping[str, float]
    shares: tuple[float, ...] | None = None  # fractions of the global batch in force; None: equal

    @property
    def slowest_rank(self) -> int | None:
        return self.ranks[0] if self.ranks else None

    def line(self) -> str:
        """The one line rank 0 logs."""
        head = "ringtrain straggler report"
        if self.shares is not None:
            head += f" (batch_shares in force {shares.shown(self.shares)})"
        if self.kind == "none":
            return f"{head}: ranks are balanced ({self.detail})"
        who = (
            f"rank {self.ranks[0]} on host {self.hosts[0]}"
            if len(self.ranks) == 1
            else f"ranks {_ranks(self.ranks)} on host{'s' if len(self.hosts) > 1 else ''} "
            f"{', '.join(self.hosts)}"
        )
        if self.kind == "shares":
            return f"{head}: {who} has more of each global batch than its speed: {self.detail}"
        verb = "is" if len(self.ranks) == 1 else "are"
        return f"{head}: {who} {verb} {self.kind}-bound: {self.detail}"


def analyse(
    times: Sequence[RankTimes],
    link_mb_s: Mapping[str, float] | None = None,
    in_force: Sequence[float] | shares.InForce | None = shares.IN_FORCE,
    per: str = "step",
    local_updates: bool = False,
    compression: str | None = None,
) -> StragglerReport:
    """The verdict for one window. ``link_mb_s`` maps host -> measured link rate (MB/s);
    ``in_force``: the shares of the global batch over the window in rank order (None: equal),
    or the record to take them from (by default the engine's; shares not one per rank are
    left out); ``per``: what the times are means over ("round" with per-rank inner steps,
    where a rank's round, not its step, is what the others wait for); ``local_updates``: the
    job averages weights every few steps (``sync_every``), so its waits are outer exchanges
    and a network verdict's hint names their settings, not the gradients'."""
    if not times:
        raise ValueError("no timings to analyse")
    links = dict(link_mb_s or {})
    per_rank = tuple(sorted(times, key=lambda t: t.rank))
    fractions = _fractions(in_force, len(per_rank))
    step = max(t.step_s for t in times)
    mean_wait = statistics.fmean(t.wait_s for t in times)

    def report(kind: str, ranks: Sequence[int], detail: str) -> StragglerReport:
        hosts = tuple(dict.fromkeys(t.host for t in per_rank if t.rank in ranks))
        return StragglerReport(kind, tuple(ranks), hosts, step, detail, per_rank, links, fractions)

    if len(links) > 1:
        med_link = statistics.median(links.values())
        slow_hosts = [h for h, r in links.items() if r < SLOW_LINK_FACTOR * med_link]
        # A rank on a slow link is also busier (its transport competes for its cores and its
        # sends block), so a slow link explains a straggler on the same host.
        if slow_hosts and mean_wait > MIN_EXCESS * step:
            ranks = [t.rank for t in per_rank if t.host in slow_hosts]
            rates = ", ".join(f"{h} {links[h]:.1f} MB/s" for h in slow_hosts)
            return report(
                "network",
                ranks,
                f"link {rates} vs median {med_link:.1f} MB/s; every rank waits "
                f"{mean_wait:.3f} s/{per} for communication.\n"
                f"HINT: fix or avoid that link, or {_fewer_bytes(local_updates, compression)}",
            )
    busy = _busy_verdict(per_rank, fractions, step, per)
    if busy is not None:
        return report(*busy)
    if mean_wait > COMM_BOUND * step:
        # The hosts on the slowest link, ties included: with two hosts there is one link between
        # them, and both measure it alike.
        floor = min(links.values(), default=0.0)
        on_slowest = {h for h, r in links.items() if r <= floor * LINK_TIE}
        ranks = [t.rank for t in per_rank if not on_slowest or t.host in on_slowest]
        return report(
            "network",
            ranks,
            f"every rank waits {mean_wait:.3f} s of a {step:.3f} s {per} for communication "
            "that did not overlap with compute.\n"
            f"HINT: {_fewer_bytes(local_updates, compression)}",
        )
    return report(
        "none",
        [],
        f"{per} {step:.3f} s: input {statistics.fmean(t.input_s for t in times):.3f} s, compute "
        f"{statistics.fmean(t.compute_s for t in times):.3f} s, waiting {mean_wait:.3f} s",
    )


# Where synchronous steps wait for the link even with their gradients compressed, what is left
# is to send them less often: the local updates of docs/engine.md, named as that page names them.
LOCAL_UPDATES = (
    "train with local updates, which send the weights once every H steps instead of the "
    "gradients every step (DistributedOptimizer(sync_every=H) or RINGTRAIN_SYNC_EVERY=auto; "
    'docs/engine.md, "Local updates")'
)
# Compressions that still send 16 bits per element: a stronger one sends fewer bytes.
HALF_PRECISION = ("fp16", "bf16")


def _fewer_bytes(local_updates: bool, compression: str | None = None) -> str:
    """What a network verdict suggests: the settings that move fewer bytes, or less often, in
    the job's mode (gradients every step, or weights every ``sync_every`` steps), never the
    compression already in use."""
    if local_updates:
        return (
            "exchange fewer bytes or less often: outer_compression='int4', a larger "
            "sync_every; or hide the exchange behind the inner steps (outer_overlap=True)."
        )
    if compression is None or compression.split()[0] == "none":  # also auto's "none (chosen...)"
        return (
            "send fewer bytes (--compression fp16/powersgd/topk) or communicate less often "
            f"(backward_passes_per_step > 1); where compressed steps still wait for it, "
            f"{LOCAL_UPDATES}."
        )
    stronger = (
        "compress further (--compression powersgd/topk), "
        if compression.split()[0] in HALF_PRECISION  # "fp16", or "fp16 (chosen by ...)"
        else ""
    )
    return (
        f"{LOCAL_UPDATES}: the gradients are already compressed ({compression}) and the steps "
        f"still wait for the link; or {stronger}communicate less often "
        "(backward_passes_per_step > 1)."
    )


def _fractions(
    in_force: Sequence[float] | shares.InForce | None, size: int
) -> tuple[float, ...] | None:
    """The shares in force as fractions (None: equal, or not one positive number per rank)."""
    given = in_force.take() if isinstance(in_force, shares.InForce) else in_force
    if given is None or len(given) != size or any(not f > 0 for f in given):
        return None
    fractions = shares.fractions_of(given, size)
    return None if len(set(fractions)) == 1 else fractions


def _busy_verdict(
    per_rank: Sequence[RankTimes],
    fractions: tuple[float, ...] | None,
    step: float,
    per: str = "step",
) -> tuple[str, list[int], str] | None:
    """The rank the others wait for, if one is busy well above the median of the others (input,
    compute or, with shares in force, a share too large for its speed), as (kind, ranks,
    detail)."""
    slowest = max(per_rank, key=lambda t: t.busy_s)
    at = {t.rank: i for i, t in enumerate(per_rank)}
    i = at[slowest.rank]

    def med(values: Sequence[float]) -> float:
        # The median of the *other* ranks: with two, that of both is their mean, which halved
        # every excess (10x slower read 1.8x) and aimed the sync_every advice at the mean.
        return statistics.median(v for j, v in enumerate(values) if j != i)

    if len(per_rank) < 2:
        return None
    med_busy = med([t.busy_s for t in per_rank])
    if not (
        slowest.busy_s > SLOW_FACTOR * med_busy and slowest.busy_s - med_busy > MIN_EXCESS * step
    ):
        return None
    # Per sample: each rank's times scaled to an equal share (as measured where none are set).
    scale = shares.per_equal_share([1.0] * len(per_rank), fractions)
    inputs = [t.input_s * scale[at[t.rank]] for t in per_rank]
    computes = [t.compute_s * scale[at[t.rank]] for t in per_rank]
    med_input, med_compute = med(inputs), med(computes)
    med_each = med([a + b for a, b in zip(inputs, computes)])
    gain = shares.predict([max(t.busy_s, 1e-9) for t in per_rank], slowest.wait_s, fractions)
    unit = f"s/{per}" if fractions is None else "s per equal share"
    of = "" if fractions is None else f" (it takes {fractions[i]:.1%} of each global batch)"
    if fractions is not None and inputs[i] + computes[i] <= SLOW_FACTOR * med_each:
        return (
            "shares",
            [slowest.rank],
            f"busy {slowest.busy_s:.3f} s/{per} vs median {med_busy:.3f} s, taking "
            f"{fractions[i]:.1%} of each global batch at {_x(inputs[i] + computes[i], med_each)} "
            f"the median rank's time per sample ({inputs[i] + computes[i]:.3f} {unit} vs "
            f"{med_each:.3f} s); the other ranks wait for it.\n"
            "HINT: give each rank a share in proportion to its speed:\n" + gain.line(),
        )
    if inputs[i] - med_input > computes[i] - med_compute:
        return (
            "input",
            [slowest.rank],
            f"data loading {inputs[i]:.3f} {unit} vs median {med_input:.3f} s "
            f"({_x(inputs[i], med_input)}){of}; the other ranks wait for it.\n"
            "HINT: more DataLoader workers or faster storage on that host.",
        )
    remedy = (
        'or give the faster ranks more of each global batch (docs/engine.md, "Hosts of '
        'unequal speed"):\n' + gain.line()
        if per == "step"
        # Per-rank inner steps in force: the split to change is theirs.
        else "or give it fewer inner steps a round in sync_every, about "
        f"{med_compute / computes[i]:.0%} of its steps now, so that its round takes the median "
        'rank\'s time (docs/engine.md, "Hosts of unequal speed").'
    )
    return (
        "compute",
        [slowest.rank],
        f"compute {computes[i]:.3f} {unit} vs median {med_compute:.3f} s "
        f"({_x(computes[i], med_compute)}){of}; the other ranks wait for it.\n"
        "HINT: check for other processes on its cores (--bind-to core), its thread count "
        "(OMP_NUM_THREADS) and whether its hardware differs; " + remedy,
    )


def shares_gain(busy_s: Sequence[float]) -> tuple[list[float], float]:
    """Shares of the global batch in proportion to each rank's speed (1 / its busy seconds at
    equal shares) as fractions, and what they would gain on the busy part of a step
    (communication left out): :func:`ringtrain.diagnostics.shares.predict`."""
    rates = [1.0 / max(b, 1e-12) for b in busy_s]
    whole = sum(rates)
    return [r / whole for r in rates], shares.predict([max(b, 1e-12) for b in busy_s]).gain


def _x(value: float, reference: float) -> str:
    return f"{value / reference:.1f}x" if reference > 0 else "n/a"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
