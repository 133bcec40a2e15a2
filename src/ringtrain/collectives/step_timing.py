"""Per-step timings for the straggler report, and the link probe that goes with them.

:class:`StepTimer` is fed by DistributedOptimizer (step start and end, backward done, waiting
for communication) and by a global forward pre-hook (first forward after a step, which ends the
time spent on input). Every ``straggler_report_steps`` steps all ranks gather their mean timings,
host leaders probe their links, and :func:`ringtrain.diagnostics.straggler.analyse` decides;
rank 0 logs the verdict in one line and every rank keeps it for :func:`last_report`.

The gathering runs inside ``step()`` after every bucket is done, on the set's ``engine`` group,
which is idle then, so it never interleaves with gradient traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ringtrain.diagnostics import shares
from ringtrain.diagnostics.straggler import RankTimes, StragglerReport, analyse
from ringtrain.runtime import departures
from ringtrain.transport import group_ops

log = logging.getLogger("ringtrain")

# Bytes each host leader sends its neighbours to measure a link: small enough to cost ~0.2 s at
# 10 Mbit/s, large enough that latency does not dominate at 1 Gbit/s.
PROBE_BYTES = 256 * 1024
# Transfers each link probe times, a barrier before each, the fastest counting: one is slow
# wherever the sending leader was late (descheduled on a busy host, or held by its own slow link).
PROBE_ROUNDS = 2
# The final report (at shutdown) waits this long for every rank to come to its shutdown: a rank
# that comes later gets none, and neither do the others, instead of waiting for it until the
# transport timeout inside the report's all-gather.
FINAL_WAIT_S = 30.0
FINAL_LOOK_S = 0.1  # how often a rank at shutdown looks for the others' posts
FINAL_PREFIX = "ringtrain/straggler/final"
GO = "go"

_last: StragglerReport | None = None


def last_report() -> StragglerReport | None:
    """The most recent straggler report on this rank (None before the first).

    ``report.kind`` ("compute", "input", "network" or "none"), ``report.ranks``, and the
    per-rank means in ``report.per_rank``; ``report.line()`` is what rank 0 logs."""
    return _last


straggler_report = last_report


@dataclass(frozen=True)
class RoundEnds:
    """Where the ranks take different inner steps a round (``sync_every=[48, 16]``), their step
    counts differ, so reports come at the ends of rounds: after this rank's step, ``ended``
    rounds are done, and the shortest rank's round is ``shortest`` steps (alike on every
    rank)."""

    ended: int
    shortest: int


@dataclass
class _Window:
    steps: int = 0
    rounds: int = 0
    input_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    compression: str | None = None  # the gradients' compression over the window's steps


@dataclass
class StepTimer:
    """Timestamps of one rank's steps. ``clock`` is injectable for tests."""

    every: int
    rank: int
    host: str
    host_of_rank: list[str]
    group: Any
    clock: Callable[[], float] = time.perf_counter
    # Called at every step's end (rank 0's Kubeflow Trainer status counts steps with it).
    on_step: Callable[[], None] | None = None
    _window: _Window = field(default_factory=_Window)
    _step_end: float | None = None
    _forward_start: float | None = None
    _wait_start: float | None = None
    _wait_s: float = 0.0
    _steps: int = 0
    _rounds_ended: int = 0
    _per_round: bool = False  # per-rank inner steps: reports per round, at rounds' ends
    _local: bool = False  # local updates: the waits are outer exchanges (the report's hint)
    _hook: Any = None

    def __post_init__(self) -> None:
        global _last
        # A new job (init after a shutdown in the same process): no report of the last one.
        _last = None
        shares.IN_FORCE.take()
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _on_forward(self, _module: Any, _args: Any) -> None:
        if self._forward_start is None:
            self._forward_start = self.clock()

    def wait_started(self) -> None:
        self._wait_start = self.clock()

    def wait_done(self) -> None:
        if self._wait_start is not None:
            self._wait_s += self.clock() - self._wait_start
            self._wait_start = None

    def waited(self, seconds: float) -> None:
        """``seconds`` of this step went to waiting for peers outside the gradient exchange
        (local updates' outer steps)."""
        self._wait_s += seconds

    def step_done(
        self,
        rounds: RoundEnds | None = None,
        local: bool = False,
        compression: str | None = None,
        trial: bool = False,
    ) -> None:
        """End of an optimizer step; every ``every`` steps this gathers and reports. With
        ``rounds`` (per-rank inner steps), at the end of every ``every`` steps' worth of the
        shortest round instead, in rounds every rank ends alike, and per round. ``local``: the
        step is one of local updates (``sync_every``); ``compression``: the gradients'
        compression it used (for the report's hint); ``trial``: it was one of
        ``compression="auto"``'s measuring or trying steps (alike on every rank), which the
        window leaves out: uncompressed, or timed with the decision's collectives, they are
        not the chosen method's steps."""
        now = self.clock()
        self._local = local
        if rounds is not None and rounds.ended < self._rounds_ended:
            self._rounds_ended = rounds.ended  # counted anew (another optimizer, a re-forming)
        round_ended = rounds is not None and rounds.ended > self._rounds_ended
        if self._step_end is not None and not trial:
            self._window.compression = compression
            start = self._forward_start if self._forward_start is not None else self._step_end
            w = self._window
            w.steps += 1
            w.input_s += start - self._step_end
            w.compute_s += (now - start) - self._wait_s
            w.wait_s += self._wait_s
        self._steps += 1
        if self.on_step is not None:
            self.on_step()
        self._wait_s = 0.0
        self._forward_start = None
        if rounds is None:
            due = self._steps % self.every == 0 if self.every > 0 else False
        else:
            self._per_round = True
            self._window.rounds += rounds.ended - self._rounds_ended
            self._rounds_ended = rounds.ended
            every = max(1, round(self.every / rounds.shortest))
            due = self.every > 0 and round_ended and rounds.ended % every == 0
        if due and self._window.steps:
            self.report()
        self._step_end = self.clock()

    def final_report(self, store: Any = None) -> None:
        """The report for the steps since the last one, at shutdown (a no-op if there are none).

        The ranks first agree in the job's ``store`` that every one of them has come to its
        shutdown with steps to report (:func:`final_decision`): a rank that comes late, never
        comes, or left failing would otherwise hold the others' all-gather until the transport
        timeout, and the report would be dropped without a word. A timer that never reports
        (``every`` 0: it only counts steps) has none to give."""
        if self.every <= 0:
            return
        steps = self._window.steps
        if store is not None and group_ops.size(self.group) > 1:
            decision = final_decision(
                store, group_ops.rank(self.group), group_ops.size(self.group), steps
            )
            if decision != GO:
                if decision:
                    log.warning("ringtrain: no final straggler report: %s", decision)
                return
        if steps:
            try:
                self.report()
            except Exception as e:  # a peer is gone after it came; shutdown goes on without it
                log.warning("ringtrain: no final straggler report: %s", e)

    def report(self) -> StragglerReport:
        global _last
        w, self._window = self._window, _Window()
        # Per round where the ranks' rounds differ in steps (every rank ends them alike).
        per, n = ("round", w.rounds) if self._per_round and w.rounds else ("step", w.steps)
        mine = RankTimes(self.rank, self.host, w.input_s / n, w.compute_s / n, w.wait_s / n)
        gathered: list[Any] = [None] * group_ops.size(self.group)
        group_ops.all_gather_object(gathered, mine, self.group)
        links = probe_links(self.group, self.host_of_rank)
        _last = analyse(
            gathered, links, per=per, local_updates=self._local, compression=w.compression
        )
        if group_ops.rank(self.group) == 0:
            log.warning("%s", _last.line())
        return _last


def final_decision(
    store: Any, rank: int, size: int, steps: int, wait_s: float | None = None
) -> str:
    """Whether the final report goes ahead, decided alike on every rank: :data:`GO`, else why
    not for this rank to log, or '' (nothing to say here: another rank decided and says why, or
    some rank had no steps to report), so that a job logs one line and no rank starts the
    report's all-gather alone.

    Each rank posts that it came, with or without steps since the last report; a rank without
    any leaves at once (nothing to report; the others see its post). A rank with steps waits up
    to ``wait_s`` (:data:`FINAL_WAIT_S`) for every other rank's post, and the first rank to
    decide sets the outcome for all (``compare_set``): GO when every rank came with steps, else
    that some ranks left the job (a departure post: they failed) or did not call ``shutdown()``
    in time. A rank that comes after the decision follows it."""
    wait_s = FINAL_WAIT_S if wait_s is None else wait_s
    came = [f"{FINAL_PREFIX}/came/{r}" for r in range(size)]
    decision = FINAL_PREFIX + "/decision"
    try:
        store.set(came[rank], "1" if steps else "0")
        deadline = time.monotonic() + wait_s
        while steps and not store.check([decision]):
            all_came = store.check(came)
            missing = [] if all_came else [r for r in range(size) if not store.check([came[r]])]
            gone = [r for r in missing if store.check([departures.PREFIX + str(r)])]
            if not missing:
                empty = any(bytes(store.get(k)) == b"0" for k in came)
                why, loud = (
                    ("some ranks had no steps since the last report", False)
                    if empty
                    else (GO, False)
                )
            elif gone:
                why, loud = (
                    f"ranks {gone} left the job without calling shutdown() (they failed or "
                    "were interrupted: see their output)",
                    True,
                )
            elif time.monotonic() > deadline:
                why, loud = (
                    f"ranks {missing} did not call shutdown() within {wait_s:g} s of rank "
                    f"{rank} (still working, stuck, or gone); shutdown goes on without them",
                    True,
                )
            else:
                time.sleep(FINAL_LOOK_S)
                continue
            decided = bytes(store.compare_set(decision, "", why)).decode()
            return GO if decided == GO else why if decided == why and loud else ""
        if steps:
            return GO if bytes(store.get(decision)).decode() == GO else ""
        return ""
    except Exception as e:  # the store is gone with a failed rank
        return f"the ranks could not agree on it in the job's store ({e})"


def probe_links(group: Any, host_of_rank: list[str], nbytes: int = PROBE_BYTES) -> dict[str, float]:
    """MB/s of each host's link, measured between host leaders (each host's first rank).

    Every leader sends ``nbytes`` to the next leader in a ring while receiving from the previous
    one, and times the arrival (the fastest of :data:`PROBE_ROUNDS`): that measures the link
    between the two. A host's rate is the
    *fastest* transfer it took part in, so a slow link is pinned on the host that all slow
    transfers share (with only two hosts both share it and both are named). With one host there
    is no link to measure.
    """
    hosts = list(dict.fromkeys(host_of_rank))
    if len(hosts) < 2:
        return {}
    leaders = [host_of_rank.index(h) for h in hosts]
    me = group_ops.rank(group)
    edges: list[tuple[str, str, float]] = []
    elapsed = float("inf")
    for _ in range(PROBE_ROUNDS):
        group_ops.barrier(group)
        if me in leaders:
            i = leaders.index(me)
            prv, nxt = leaders[(i - 1) % len(leaders)], leaders[(i + 1) % len(leaders)]
            elapsed = min(elapsed, _timed_transfer(group, prv, nxt, nbytes))
    if me in leaders:
        i = leaders.index(me)
        edges.append((hosts[(i - 1) % len(hosts)], hosts[i], nbytes / elapsed / 1e6))
    gathered: list[Any] = [None] * group_ops.size(group)
    group_ops.all_gather_object(gathered, edges, group)
    out: dict[str, float] = {}
    for part in gathered:
        for src, dst, rate in part:
            for h in (src, dst):
                out[h] = max(out.get(h, 0.0), rate)
    return out


# The probe's messages, apart by tag: "here", "send now", the payload.
_HERE, _GO, _PAYLOAD = 1, 2, 3


def _timed_transfer(group: Any, prv: int, nxt: int, nbytes: int) -> float:
    """Seconds from asking ``prv`` for ``nbytes`` to having them (while serving ``nxt`` alike).

    The clock starts once ``prv`` has said it is here: timed from this leader's own start, the
    lag between two leaders' leaving the barrier counted as transfer time (on a loaded host, a
    link of the same switch measured 0.7 MB/s beside 1 MB/s on a 10 Mbit/s one, and the report
    named the wrong host). The payload goes only when asked for, so a late receiver never
    finds it arrived already (a slow link measured fast)."""
    flag, flags = torch.zeros(1, dtype=torch.uint8), torch.empty(2, 1, dtype=torch.uint8)
    payload, got = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    works = [group_ops.send(flag, nxt, group, tag=_HERE)]
    here = group_ops.recv(flags[0], prv, group, tag=_HERE)
    asked = group_ops.recv(flags[1], nxt, group, tag=_GO)
    arrived = group_ops.recv(got, prv, group, tag=_PAYLOAD)
    assert here is not None and asked is not None and arrived is not None  # members only
    # Plain waits, never sliced: a Gloo send or receive whose timed wait runs out closes the
    # connection for good (tests/transport/test_sliced_waits.py), and a probe of a slow link
    # takes longer than a slice.
    here.wait()
    start = time.perf_counter()
    works.append(group_ops.send(flag, prv, group, tag=_GO))
    asked.wait()
    works.append(group_ops.send(payload, nxt, group, tag=_PAYLOAD))
    arrived.wait()
    elapsed = max(time.perf_counter() - start, 1e-6)
    for work in works:
        assert work is not None
        work.wait()
    return elapsed
