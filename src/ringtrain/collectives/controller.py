"""The background controller: collectives are matched across ranks by name, not submission order.

As in Horovod, a rank may submit asynchronous collectives in any order, or enter a barrier with
operations still pending. Each process set runs one controller thread per rank. Every cycle:

1. each rank sends the requests submitted since its last cycle (names and metadata; tensor data
   only for allreduces, allgathers and broadcasts of a few KiB, see
   :mod:`ringtrain.collectives.inline`) over the set's ``control`` group, so every rank holds the
   same table ``name -> rank -> request`` (requests that ran before travel as a number in the
   request cache, Horovod's response cache). From ``Config.vector_rounds_from`` ranks, a round is
   one bit vector instead (:mod:`~ringtrain.collectives.vector_round`): requests every rank
   holds in the request cache are a bit each, and the rest wait for a gathered round;
2. names that every rank has submitted (or that joined ranks stand in for) become *ready*, in the
   order they first appeared in the table, identical on every rank;
3. ready requests are checked for consistency (a mismatch fails on every rank with one message)
   and executed on the data groups, consecutive allreduces fused into one buffer; an op whose
   data came in step 1 completes locally instead, with no collective of its own.

An allreduce that repeats the request the set's fast lane reserved skips steps 1-3 and starts
at once (see :mod:`ringtrain.collectives.lane`); rounds carry each rank's lane status, and decide
when the lane opens, moves to another request, or releases a slot a peer waits in.

Every decision is a function of the exchanged table, so ranks agree on what runs next.
Decisions that depend on time (stall reports, aborts, names that ranks submitted on different
process sets: :mod:`ringtrain.collectives.crossset`) are made by the set's rank 0 and travel in
its next message; a rank its peers wait for says where it is itself
(:mod:`ringtrain.diagnostics.whereabouts`). If a peer dies, every pending handle fails, not hangs.
Shutdown: a rank votes so in its rounds, then :mod:`~ringtrain.collectives.shutdown_rules`.

The parts, each an object the controller owns, are modules of :mod:`ringtrain.collectives`: the
table every rank holds alike (``request_table``), the message and its wire (``control_round``,
``vector_round``), the fast lane's driver (``lane_control``), running ready ops on the data
groups (``execute``), and how the set ends (``shutdown_rules.Ending``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ringtrain.collectives import crossset, inline, lane, shutdown_rules, vector_round
from ringtrain.collectives.control_round import ControlChannel, Message, inline_payloads
from ringtrain.collectives.doorbell import Doorbell, Pace
from ringtrain.collectives.execute import Executor, Pending
from ringtrain.collectives.handles import Handle
from ringtrain.collectives.lane_control import LANE_DRAIN_S, LaneDriver, LaneHandle, split_settled
from ringtrain.collectives.request_table import RequestTable
from ringtrain.collectives.requests import Request, local_errors, mismatch
from ringtrain.collectives.vector_round import LaneView, VectorChannel, VectorRounds
from ringtrain.config import Config
from ringtrain.diagnostics import stall, timeline, whereabouts
from ringtrain.errors import (
    CollectiveAbortedError,
    CollectiveArgumentError,
    CollectiveError,
    CollectiveMismatchError,
    SecurityError,
    StallError,
)
from ringtrain.runtime import abort, departures, exit_guard
from ringtrain.runtime.communicator import Communicator

log = logging.getLogger("ringtrain")

# A controller with nothing of its own in flight naps between rounds. Joining a round then can
# make no op ready (every op waits for this rank's submission, which wakes it at once): it joins
# only for what peers may need of it, none of it urgent (a shutdown vote, a lane slot to release
# after lane.RELEASE_S, rank 0's stall and cross-set verdicts, the doze agreement), so it naps
# IDLE_NAP_S, or the cycle time if longer. A nap is also how late this rank's next submission may
# come without costing a round: napping one cycle time (1 ms) made a rank whose app thread woke a
# little late join an empty round, and that round a second one for every rank (1.3-2.3 rounds per
# op of a loop at 4 ranks under load; 1.00 with these naps: docs/benchmarks/log/
# 2026-11-28-idle-naps.md).
IDLE_NAP_S = 0.05
# After this many idle rounds in a row on every rank (200 ms of quiet), the controllers stop
# polling and block on a doorbell key in the rendezvous store until some rank submits or shuts
# down: an idle round costs every rank CPU that its next work needs.
DOZE_AFTER_IDLE_CYCLES = 4
JOIN_NAME = "__join__"
_NONE = frozenset[int]()  # no rank joined


class Controller:
    """Negotiates and runs the collectives of one process set on this rank."""

    def __init__(
        self,
        comm: Communicator,
        config: Config,
        clock: Callable[[], float] = time.monotonic,
        board: crossset.Board | None = None,
        channel: ControlChannel | None = None,
        start: bool = True,
        vectors: VectorChannel | None = None,
    ) -> None:
        """``channel``, ``vectors`` and ``start=False`` are for the simulated coordinator
        (:mod:`ringtrain.collectives.simulated`): its own wires, and rounds it drives itself."""
        self.comm = comm
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._new: list[str] = []  # names submitted since this rank's last round
        self._pending: dict[str, Pending] = {}  # this rank's ops in flight
        self._requests = RequestTable(config.cache_capacity)  # alike on every rank
        self._stall = stall.StallInspector(config.stall_warning_s, config.stall_shutdown_s)
        self._where = whereabouts.Whereabouts(comm, config.stall_warning_s, config.stall_shutdown_s)
        self._end = shutdown_rules.Ending()
        self._counters: dict[str, int] = {}
        self._pace = Pace()
        self._doorbell = Doorbell(comm.store, comm.set_id, comm.set_rank)
        # Same name on other process sets: shared by this process's controllers (see crossset).
        if board is None and comm.store is not None and config.check_consistency:
            board = crossset.Board(comm.store, comm.ranks[comm.set_rank], comm.notes)
        self._watch = (
            crossset.Watch(board, comm.set_id, comm.ranks, comm.set_rank, clock)
            if board is not None
            else None
        )
        self._executor = Executor(comm, config)
        # The fast lane (collectives.lane) and what the rounds decided about it (lane_control).
        self._fast: LaneDriver | None = None
        lane_group = comm.optional_group("lane")
        if config.fast_lane and comm.size > 1 and lane_group is not None:
            fast = lane.Lane(comm.size, lane_group, config.reproducible)
            self._fast = LaneDriver(fast, self, self._lock, comm, clock)
        self._world = abort.generation  # elastic: this controller's waits end when it is replaced
        self._channel = channel if channel is not None else ControlChannel(comm, self._world)
        # From Config.vector_rounds_from ranks, rounds are bit vectors (collectives.vector_round).
        self._vector: VectorRounds | None = None
        if config.vector_rounds_at(comm.size):
            self._vector = VectorRounds(vectors or VectorChannel(comm, self._world))
        self._thread = threading.Thread(
            target=self._run, name=f"ringtrain-controller-{comm.set_id}", daemon=True
        )
        if start:
            self._thread.start()

    # ---- submitting side (user threads) ------------------------------------------------------

    def auto_name(self, kind: str) -> str:
        """A name for an unnamed op; ranks must submit unnamed ops of a kind in the same order."""
        with self._lock:
            n = self._counters.get(kind, 0)
            self._counters[kind] = n + 1
        return f"{kind}.noname.{n}"

    def submit(
        self,
        request: Request,
        tensors: list[torch.Tensor],
        outputs: list[torch.Tensor] | None = None,
        finish: Callable[[Any], Any] | None = None,
    ) -> Handle:
        fast = self._fast
        if self._end.failure is not None:  # settled outside the lock: it may wait for exit codes
            self._end.failure = departures.with_exit_codes(self._end.failure)
            raise departures.again(self._end.failure)
        with self._lock:
            if self._end.failure is not None:
                raise departures.again(self._end.failure)
            if self._end.closed or self._end.shutdown:
                raise CollectiveAbortedError(
                    f"cannot submit {request.name!r}: ringtrain is shutting down"
                )
            if request.name in self._pending:
                raise CollectiveArgumentError(
                    f"a collective named {request.name!r} is already in flight on this rank.\n"
                    "HINT: names must be unique among pending operations; wait for the first "
                    "(synchronize) or give the second another name."
                )
            reserved = fast.lane.reserved if fast is not None else None
            if fast is not None and reserved is not None and reserved.name == request.name:
                # Made before the claim starts the op, so that little runs between its start
                # and the caller's wait (lane.Lane._launch); other names (a burst's) cannot claim.
                lane_handle = LaneHandle(request.name, finish, fast)
                pending = Pending(request, tensors, outputs, lane_handle)
                lane_handle.claim = fast.lane.try_claim(request, tensors, outputs)
                if lane_handle.claim is not None:  # no negotiation: the op is on its way
                    self._pending[request.name] = pending
                    return lane_handle
            handle: Handle[Any] = Handle(request.name, finish)
            cid = self._requests.cache_id(request) if self._vector is not None else -1
            self._pending[request.name] = Pending(request, tensors, outputs, handle, cid)
            self._new.append(request.name)
            bell = self._doorbell.disarm()
        if not self._pace.wake.is_set():  # a burst's later ops: the controller has yet to wake
            self._pace.wake.set()
        self._doorbell.ring(bell)
        return handle

    def request_shutdown(self, timeout: float | None = None, failure: str = "") -> bool:
        """Leave the set: the next round tells every rank, which then end the set alike (the
        module docstring's shutdown rules; ``failure``: this rank's uncaught exception, quoted
        to them). Waits at most ``timeout`` for the set to end here; returns whether it did."""
        with self._lock:
            self._end.shutdown = True
            self._end.leaving = failure
        self.wake()  # a dozing controller checks for a shutdown vote under the lock, then dozes
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "ringtrain controller of set %d did not stop within %s s: a peer's controller "
                "does not answer (stopped, or holding its GIL); leaving without it",
                self.comm.set_id,
                timeout,
            )
            exit_guard.leave_behind(self._thread)  # still in torch calls: the exit waits for it
            return False
        return True

    def close(self) -> None:
        self.request_shutdown()

    @property
    def round_started(self) -> float | None:
        """When this rank's control round in progress began (perf_counter), None between."""
        vector = self._vector.channel.started if self._vector is not None else None
        return vector if vector is not None else self._channel.started

    def abandon(self) -> None:
        """Stop at once, without the peers (elastic: one of them failed). Pending ops fail. The
        background thread leaves at its next sliced wait (:mod:`ringtrain.runtime.abort`), and
        the process's exit waits for it (:mod:`ringtrain.runtime.exit_guard`): it may be inside
        a torch call until then."""
        with self._lock:
            self._end.closed = True
            bell = self._doorbell.disarm()
        self._pace.wake.set()
        if bell is not None:  # dozing in a store wait: wake it, so that it can leave
            try:
                self._doorbell.ring(bell)
            except Exception as e:  # the old world's store may be gone with the failed peer
                log.debug("could not wake the abandoned controller: %s", e)
        exit_guard.leave_behind(self._thread)
        self._fail_all(CollectiveAbortedError("the world was re-formed while this op was pending"))

    @property
    def board(self) -> crossset.Board | None:
        return self._watch.board if self._watch is not None else None

    def settle(self, timeout: float = 1.0) -> bool:
        """Wait until this set's controllers doze (no idle rounds), at most ``timeout`` seconds.
        For benchmarks: a measurement then starts from a quiet process, as in a job that runs
        nothing else. Returns whether they dozed; a lone rank never polls, so it is settled (and
        controllers without a store to doze on never settle, so this returns at once)."""
        if self.comm.store is None:
            return False
        return self.comm.size == 1 or self._doorbell.settled(timeout, lambda: self._end.closed)

    @property
    def rounds(self) -> int:
        """Negotiation rounds this rank took part in so far (a protocol counter)."""
        vectors = self._vector.channel.rounds if self._vector is not None else 0
        return self._channel.rounds + vectors

    def repeat_of(
        self, name: str, t: torch.Tensor, op: str, prescale: float, postscale: float
    ) -> Request | None:
        """The request an allreduce of ``t`` with these arguments submits, if this set ran it
        before: the lane's reservation, or the request cache's (collectives.resubmit)."""
        found = self._fast.lane.repeat_of(name, t, op, prescale, postscale) if self._fast else None
        return found or self._requests.repeat_of(name, t, op, prescale, postscale)

    @property
    def lane_slots(self) -> tuple[int, int]:
        """Slots of the fast lane so far, (valid, not valid): for tests and statistics."""
        fast = self._fast.lane if self._fast is not None else None
        return (fast.slots_valid, fast.slots_invalid) if fast is not None else (0, 0)

    def pending_names(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    # ---- what the lane's driver asks (lane_control.LaneHost) ------------------------------------

    def pending_of(self, name: str) -> Pending | None:
        with self._lock:
            return self._pending.get(name)

    def drop_pending(self, name: str) -> None:
        with self._lock:
            self._pending.pop(name, None)

    def renegotiate(self, name: str, handle: LaneHandle) -> None:
        """The op's lane slot was not valid: negotiate it again, or fail it if the set ended."""
        with self._lock:
            if self._end.failure is None and not self._end.closed:
                self._new.append(name)
            else:
                self._pending.pop(name, None)
                handle.set_error(
                    self._end.failure or CollectiveAbortedError(shutdown_rules.SHUT_DOWN)
                )
        self.wake()

    def wake(self) -> None:
        with self._lock:
            bell = self._doorbell.disarm()
        self._pace.wake.set()
        self._doorbell.ring(bell)

    # ---- the background thread ---------------------------------------------------------------

    def _run(self) -> None:
        abort.bind_world(self._world)  # the executor's data waits end with this controller's world
        try:
            while True:
                waiting = self._cycle()
                if self._end.closed:
                    break
                if waiting:
                    # Peers owe us submissions (or we owe them): the next exchange blocks until
                    # they arrive, so sleeping would only add latency.
                    self._pace.idle_cycles = 0
                    continue
                if self._pace.doze:
                    self._sleep_until_rung()
                    continue
                self._pace.idle_cycles = 0 if self._pace.active else self._pace.idle_cycles + 1
                # Alone in the set, nothing can arrive but a local submission: wait for it.
                alone = self.comm.size == 1
                self._pace.wake.wait(None if alone else self._nap_s())
                self._pace.wake.clear()
        except (CollectiveError, SecurityError) as e:  # secure mode names the peer: keep it
            self._fail_all(e)
        except Exception as e:  # a peer died or the network failed: fail loudly, never hang
            self._fail_all(
                CollectiveAbortedError(
                    f"collectives of process set {self.comm.set_id} stopped: a peer rank failed or "
                    f"became unreachable ({type(e).__name__}: {str(e).strip()[:300]}).\n"
                    "HINT: the launcher's message names the rank that failed first."
                )
            )
        finally:
            self._end.closed = True
            if self._fast is not None:
                # A rank that fails cannot count on its peers to match its claims.
                failing = self._end.failure is not None or bool(self._end.leaving)
                self._fast.drain(0.0 if failing else LANE_DRAIN_S)
            if self._watch is not None:
                self._watch.clear()

    def _nap_s(self) -> float:
        """How long a controller with nothing of its own in flight waits for a submission
        before joining a round for its peers (see IDLE_NAP_S)."""
        return max(IDLE_NAP_S, self.config.cycle_time_ms / 1000.0)

    def _sleep_until_rung(self) -> None:
        """Every rank dozes on the same key until one of them submits or shuts down. The key
        names the episode, which every rank counts alike (they decided to doze in one round)."""
        key = self._doorbell.next_episode()
        with self._lock:
            # A submission that came in after the round that decided this rings at once.
            rung = bool(self._new) or self._end.shutdown
            self._doorbell.armed = None if rung else key
        if rung:
            self._doorbell.ring(key)
        self._pace.doze = False
        self._pace.idle_cycles = 0
        try:
            self._doorbell.wait(key)
        finally:
            with self._lock:
                self._doorbell.armed = None

    def _cycle(self) -> bool:
        """One negotiation round. Returns True if submitted ops still wait for some ranks."""
        if self._fast is not None:
            self._fast.settle()
        rounds = self._vector
        if rounds is not None and not rounds.gather_next:
            self._vector_cycle(rounds)
        else:
            self._gather_cycle(rounds)
        return bool(self._requests) or (rounds is not None and bool(rounds.pending))

    def _may_doze(self, submitted: bool) -> bool:
        """This rank's doze vote (under the lock): idle long enough, nothing in flight."""
        return (
            not submitted
            and not self._end.shutdown
            and not self._requests
            and (self._vector is None or not self._vector.pending)
            and self._pace.idle_cycles >= DOZE_AFTER_IDLE_CYCLES
            and self.comm.store is not None
            and (self._fast is None or self._fast.quiet())
        )

    def _gather_cycle(self, rounds: VectorRounds | None) -> None:
        """A gathered round: every rank's message to every rank (control_round). With vector
        rounds, this rank's cached requests pending by bits join the table here too."""
        with self._lock:
            new, self._new = self._new, []
            if rounds is not None:
                new = [n for n in rounds.take_all() if n in self._pending] + new
            subs = [self._pending[n] for n in new]
            reqs = [p.request for p in subs]
            ids = [self._requests.cache_id(r) for r in reqs]
            mine = Message([i if i >= 0 else r for i, r in zip(ids, reqs)], self._end.shutdown)
            mine.leaving = self._end.leaving
            mine.busy = bool(self._pending)
            mine.idle = self._may_doze(bool(reqs))
        if self._fast is not None:
            mine.lane = self._fast.lane.status()
        mine.inline = inline_payloads(subs, self.comm.world_rank)
        known = self._requests
        stuck = self._watch.stuck(known.by_name, known.first_seen) if self._watch else None
        self._where.look(known.waiting, self._clock())
        if self.comm.set_rank == 0:
            mine.abort = self._inspect()
            carried: tuple[tuple[str, str], ...] = ()
            if rounds is not None:  # what a vector round found, sent now
                carried, rounds.carried = rounds.carried, ()
            if stuck and self._watch is not None:
                carried += self._watch.mismatches(stuck)
            mine.mismatched = tuple(dict(carried).items())
        rec = timeline.current()
        started = time.perf_counter()
        messages = self._channel.exchange(mine)
        if rec.enabled and any(m.requests for m in messages):  # idle rounds are not drawn
            rec.span(
                f"collectives set {self.comm.set_id}",
                "NEGOTIATE",
                started,
                time.perf_counter(),
                {"submitted": sum(len(m.requests) for m in messages)},
            )
        now, table = self._clock(), self._requests
        for set_rank, msg in enumerate(messages):
            table.add(set_rank, self.comm.ranks[set_rank], msg.requests, msg.inline, now)
        abort = messages[0].abort
        if abort:
            raise StallError(abort)
        for name, problem in messages[0].mismatched:
            if self._watch is not None:  # keep posting it for the other set's rank 0
                self._watch.linger(name, self._requests.by_name.get(name, {}))
            self._fail_name(name, CollectiveMismatchError(problem))
        size = self.comm.size
        ready = [n for n in table.by_name if table.is_ready(n, size, JOIN_NAME)]
        view = LaneView.of(m.lane for m in messages)
        if rounds is not None and view is not None:
            rounds.base = view.slot_min
        if self._fast is not None and view is not None:
            alike = [table.alike(name, size) for name in ready]
            ran = [r for r in alike if r is not None and lane.eligible(r)]
            self._fast.round(view, ran, self._end.shutdown or self._busy_elsewhere())
        for name in ready:
            self._run_ready(name)
        self._executor.flush()
        self._pace.active = any(m.requests for m in messages)
        self._pace.doze = size > 1 and all(m.idle for m in messages) and not table
        if rounds is not None:  # whether another gathered round follows (VectorRounds.gathered)
            fresh = any(not isinstance(r, int) for m in messages for r in m.requests)
            rounds.gathered(fresh, bool(table))
        if any(m.shutdown for m in messages):
            self._after_votes(messages)

    def _vector_cycle(self, rounds: VectorRounds) -> None:
        """A vector round (collectives.vector_round): cached requests by their bits."""
        now = self._clock()
        why = ""  # this rank's reason to ask for a gathered round (VectorRounds.why)
        with self._lock:
            new, self._new = self._new, []
            joined = bool(self._requests.joined)
            for name in new:
                p = self._pending[name]
                cid = p.cache_id if p.cache_id >= 0 else self._requests.cache_id(p.request)
                if cid < 0 or joined or name in self._requests.by_name:
                    self._new.append(name)  # for the gathered round this one asks for
                    why = why or ("uncached" if cid < 0 else "joined" if joined else "late")
                else:
                    rounds.pending[cid] = (name, now)
            if not why:
                why = "shutdown" if self._end.shutdown else "overdue" if rounds.overdue(now) else ""
            idle = self._may_doze(bool(new))
        status = self._fast.lane.status() if self._fast is not None else None
        if not why and status is not None and not vector_round.fits(status, rounds.base):
            why = "lane"
        known = self._requests
        stuck = self._watch.stuck(known.by_name, known.first_seen) if self._watch else None
        if self.comm.set_rank == 0:
            if stuck and self._watch is not None:
                rounds.carried += self._watch.mismatches(stuck)
            why = why or ("verdict" if rounds.carried else "abort" if self._inspect() else "")
        words, gather = vector_round.words_for(len(self._requests.cache)), rounds.asks(why)
        mine = vector_round.encode(words, rounds.pending, gather, idle, status, rounds.base)
        started = time.perf_counter()
        got = vector_round.decode(rounds.channel.exchange(mine), rounds.base)
        rounds.gather_next = got.gather_next
        if (rec := timeline.current()).enabled and got.ready:
            span = (started, time.perf_counter(), {"submitted": len(got.ready)})
            rec.span(f"collectives set {self.comm.set_id}", "NEGOTIATE", *span)
        if got.lane is not None:
            rounds.base = got.lane.slot_min
            if self._fast is not None:
                cached = [self._requests.cache[c] for c in got.ready]
                ran = [r for r in cached if lane.eligible(r)]
                self._fast.round(got.lane, ran, self._end.shutdown or self._busy_elsewhere())
        names = [rounds.pending.pop(cid)[0] for cid in got.ready]
        with self._lock:
            locals_ = [self._pending.pop(name, None) for name in names]
        me, size, none = self.comm.set_rank, self.comm.size, frozenset[int]()
        for cid, name, local in zip(got.ready, names, locals_):
            alike = rounds.alike(cid, self._requests.cache[cid], size)  # O(1) in the rank count
            self._executor.add(name, alike, local, none, me, None)
        self._executor.flush()
        self._pace.active = bool(got.ready) or bool(new)
        self._pace.doze = self.comm.size > 1 and got.idle and not self._requests

    def _busy_elsewhere(self) -> bool:
        """This rank waits for peers on other ops: a peer's lane claim must not wait for it."""
        mine = self._vector is not None and bool(self._vector.pending)
        return mine or self._requests.waits_on(self.comm.set_rank)

    def _after_votes(self, messages: list[Message]) -> None:
        """Some rank voted to shut down in this round: end the set, or fail what cannot run
        (:mod:`~ringtrain.collectives.shutdown_rules`; every rank decides alike)."""
        votes = [shutdown_rules.Vote(m.shutdown, m.leaving, m.busy) for m in messages]
        me, ranks, set_id = self.comm.set_rank, self.comm.ranks, self.comm.set_id
        table = self._requests
        if shutdown_rules.set_ends(votes, table.by_name):
            self._end.closed = True
            error = shutdown_rules.error(votes, me, ranks, set_id)
            with self._lock:
                self._end.failure = self._end.failure or error
            if self._fast is not None:
                failed = any(v.leaving for v in votes)
                self._fast.drain_at_end(failed, leaving=bool(self._end.leaving))
            self._fail_all(error)
            return
        for name, missing in shutdown_rules.doomed(votes, table.by_name, table.joined).items():
            if name != JOIN_NAME:
                self._fail_name(name, shutdown_rules.error(votes, me, ranks, set_id, missing))

    def _run_ready(self, name: str) -> None:
        by_rank, payloads = self._requests.take(name)
        me = self.comm.set_rank
        with self._lock:
            local = self._pending.pop(name, None)
        if name == JOIN_NAME:
            self._requests.joined.clear()
            if local:
                local.handle.set_result(self._requests.last_joined)
            return
        problem = (
            mismatch(name, by_rank, self.comm.ranks)
            if self.config.check_consistency
            else local_errors(name, by_rank)
        )
        if problem:
            self._executor.flush()
            if local:
                cls = (
                    CollectiveArgumentError
                    if any(r.error for r in by_rank.values())
                    else CollectiveMismatchError
                )
                local.handle.set_error(cls(problem))
            return
        joined = frozenset(self._requests.joined - set(by_rank)) if self._requests.joined else _NONE
        self._requests.remember(by_rank)
        if payloads is not None:
            req = by_rank[min(by_rank)]
            if not inline.usable(req, payloads, by_rank, self.comm.ranks):
                payloads = None
        self._executor.add(name, by_rank, local, joined, me, payloads)

    def _fail_name(self, name: str, error: CollectiveError) -> None:
        """Drop ``name`` from the table on every rank alike; fail it here if this rank has it."""
        self._requests.drop(name)
        with self._lock:
            local = self._pending.pop(name, None)
        if local is not None:
            local.handle.set_error(error)

    def _inspect(self) -> str:
        """Rank 0's time-based decisions: log stall warnings; return an abort message if due."""
        now = self._clock()
        waiting = self._requests.waiting(now, self._stall.watch_from_s)  # those it may report
        verdict = self._stall.check(waiting, self.comm.size, now, self.comm.ranks, self.comm.set_id)
        if verdict.warning:
            log.warning("%s", verdict.warning)
        return verdict.abort

    def _fail_all(self, error: CollectiveError | SecurityError) -> None:
        with self._lock:
            if self._end.failure is None:
                self._end.failure = error
            pending, self._pending = split_settled(self._pending)
            self._new = []
            if self._vector is not None:
                self._vector.pending.clear()
        for p in pending.values():
            p.handle.set_error(error)
