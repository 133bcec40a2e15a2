"""The stall inspector's policy: a pure function of what is waiting, and since when.

A collective *stalls* when some ranks submitted it and others have not, for longer than the
warning time. The report names the operation, how long it has waited, the ranks that submitted
it and the ranks that are missing, and the likely cause. After the shutdown time (if set) the
verdict carries an abort message; the controller raises it on every rank.

Time comes in as an argument, so the policy is tested with plain numbers and no sleeping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Waiting:
    """One name in the controller's table: who submitted it and when it first appeared."""

    name: str
    submitted: tuple[int, ...]  # set ranks
    since: float


@dataclass(frozen=True)
class Verdict:
    warning: str = ""
    abort: str = ""


class StallInspector:
    """Decides when to warn about, and when to abort on, stalled collectives."""

    def __init__(self, warning_s: float, shutdown_s: float) -> None:
        self.warning_s = warning_s
        self.shutdown_s = shutdown_s
        self._last_warning = float("-inf")

    @property
    def watch_from_s(self) -> float:
        """How long a name must have waited before it matters: the warning time, or the
        shutdown time where that is shorter (a shutdown time below the warning time still
        stops the job at the time it names; Horovod would never stop it)."""
        if self.shutdown_s > 0:
            return min(self.warning_s, self.shutdown_s)
        return self.warning_s

    def check(
        self,
        waiting: Mapping[str, Waiting],
        set_size: int,
        now: float,
        global_ranks: Sequence[int] | None = None,
        set_id: int = 0,
    ) -> Verdict:
        if self.warning_s <= 0 or not waiting:
            return Verdict()
        stalled = [w for w in waiting.values() if now - w.since >= self.watch_from_s]
        if not stalled:
            return Verdict()
        longest = max(now - w.since for w in stalled)
        if self.shutdown_s > 0 and longest >= self.shutdown_s:
            return Verdict(
                abort=stall_report(stalled, set_size, now, global_ranks, set_id)
                + "\n"
                + stopping(self.shutdown_s)
            )
        warned = [w for w in stalled if now - w.since >= self.warning_s]
        if not warned or now - self._last_warning < self.warning_s:
            return Verdict()
        self._last_warning = now
        return Verdict(warning=stall_report(warned, set_size, now, global_ranks, set_id))


def stopping(shutdown_s: float) -> str:
    """The last line of a stall's error (a negotiated collective's, or step()'s wait)."""
    return (
        f"ringtrain is stopping the job: the stall exceeded the shutdown time of {shutdown_s:g} s "
        "(--stall-shutdown-time, RINGTRAIN_STALL_SHUTDOWN_S, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)."
    )


def stall_report(
    stalled: Sequence[Waiting],
    set_size: int,
    now: float,
    global_ranks: Sequence[int] | None = None,
    set_id: int = 0,
) -> str:
    """Human-readable report: which ranks are missing which collectives, grouped by rank; a
    process set other than the world's is named (one name may be in use on several sets)."""
    to_global = list(global_ranks) if global_ranks is not None else list(range(set_size))
    where = f" on process set {set_id} (ranks {to_global})" if set_id else ""
    missing_by_rank: dict[int, list[str]] = {}
    for w in stalled:
        for r in range(set_size):
            if r not in w.submitted:
                missing_by_rank.setdefault(to_global[r], []).append(w.name)
    lines = [
        f"stall{where}: {len(stalled)} collective(s) waited for ranks that have not submitted them:"
    ]
    for w in sorted(stalled, key=lambda w: w.since):
        have = [to_global[r] for r in w.submitted]
        lines.append(f"  {w.name!r} waiting {now - w.since:.0f} s; submitted by ranks {have}")
    for rank, names in sorted(missing_by_rank.items()):
        shown = ", ".join(repr(n) for n in names[:5]) + (
            f" and {len(names) - 5} more" if len(names) > 5 else ""
        )
        lines.append(f"  rank {rank} has not submitted: {shown}")
    lines.append(
        "HINT: the missing ranks may have skipped a collective (a data-dependent branch, an "
        "uneven number of batches: see ringtrain.join()), be stuck elsewhere, or be much slower; "
        "a missing rank still running logs where its threads are."
    )
    return "\n".join(lines)
