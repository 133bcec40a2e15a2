"""How ranks leave the job, posted where their peers look: a rank that failed is named, not guessed.

A rank that leaves posts one record under ``ringtrain/departed/<world rank>`` in the job's store
(the launcher's, torchrun's, or rank 0's): whether it failed (an uncaught exception: its type and
message) or finished (its script ended, ``ringtrain.shutdown()``), its host and the time. The
post is made as early as the rank knows: a failure from ``sys.excepthook``, before the traceback
is printed and before any at-exit work that could block; a finish at shutdown.

A rank that ends with ``sys.exit(n)`` can post only that it finished: Python runs the at-exit
hooks without the code (``SystemExit`` never reaches ``sys.excepthook``, and no hook or
attribute holds it). Under ``ringtrain run`` the launcher records each rank's exit code in the
store as its agent reports it (:data:`ringtrain.launch.failures.EXITED_PREFIX`), before it
stops anyone, and a peer that reads a "finished" post waits up to :data:`EXIT_WAIT_S` for that
record: a non-zero code makes the post a failure ("exited with code 3"). Under torchrun,
mpirun or Slurm no one records it, and the peer says the rank finished.

A rank that ends because the job was interrupted (its uncaught ``KeyboardInterrupt``, or, under
``ringtrain run``, any end after the launcher forwarded Ctrl-C or SIGTERM, as the launcher's
record says) did not fail: its peers read "the job was interrupted (SIGINT from the launcher)",
with no failure to fix. A rank that stops on a preemption, at a step the ranks saved
(:mod:`ringtrain.checkpoint.preemption`), posts that with the step: an elastic job's peers, which
go on without it, name the stop, not a failure.

A peer that was waiting for it then sees its wait break (Gloo: "Connection closed by peer" once
the departed process is gone, or the controller's shutdown vote, see
:mod:`ringtrain.collectives.controller`) and calls :func:`peer_error`, which reads the posts and
raises :class:`~ringtrain.errors.PeerFailedError` naming the rank and its own words, failures
first. A rank that left without a post (``os._exit``, a signal) is named from ``ringtrain
run``'s record of its end, waited for a moment; elsewhere (torchrun, mpirun), from the process
itself where it ran on the peer's machine: each rank says at ``bind`` which process it is
(:mod:`ringtrain.runtime.processes`), and a peer that sees the same processes (the same kernel and pid namespace)
finds it ended, and posts that for it (:data:`VANISHED`), for the peers on other machines, which
cannot look; they knock on its door instead (a socket it listens on, refused once the process is
gone). Where nothing can be read (the store left with the rank that served it, as under plain
mpirun when rank 0 fails), the error says what the transport said.

The record is the rank's last word, not a protocol: nothing waits for it, every read is bounded
by :data:`READ_TIMEOUT_S`, and a store that is gone makes every call here a no-op.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

from ringtrain import environ
from ringtrain.environ import Ringtrain
from ringtrain.errors import RAN_FEWER, CollectiveAbortedError, CollectiveError, PeerFailedError
from ringtrain.launch.failures import INTERRUPTED, exited_key
from ringtrain.runtime import heartbeat, processes
from ringtrain.runtime.contracts import Store
from ringtrain.runtime.processes import Known
from ringtrain.security.notes import PLAIN, Notes

log = logging.getLogger("ringtrain")

PREFIX = "ringtrain/departed/"
POSTED = "ringtrain/departures"  # how many posts were made: a look that waits reads them anew
READ_TIMEOUT_S = 2.0  # a peer reading the posts after its wait broke; the store may be gone
# How long a peer that found a "finished" post waits for the launcher's record of that rank's
# exit code: the rank's process ends after its at-exit shutdown and interpreter finalization,
# which took 10 s on a 2-core machine under load (the record comes at once after it). The wait
# delays no job's end: the launcher ends the job when the exit arrives, whatever the peer does.
EXIT_WAIT_S = 15.0
# How long a peer whose wait broke, with no post to read, waits for the launcher's record of
# the exit of a rank that left without a word (os._exit, a signal): its agent's reaping.
UNPOSTED_WAIT_S = 5.0
# The same where no launcher records ends, for a rank's process to be seen ended on this
# machine: a wait breaks as the process closes its sockets, moments before it ends. Short: a
# wait that broke while every process lives (a peer's abort) waits it out for nothing.
VANISH_WAIT_S = 1.0
# The same for a rank on another machine, for a peer on its machine to post that it ended: that
# peer's wait breaks about when this one's does, then it looks and posts (0.07-0.21 s after the
# kill in tests/cluster/test_vanished_elsewhere.py, on a loaded 2-core machine). Where no one
# can post (a rank alone on its machine), a peer's error comes this much later.
TOLD_WAIT_S = 2.0
# How often such a peer knocks on the doors of ranks on other machines (runtime/processes.py).
KNOCK_EVERY_S = 0.5
FAILED, FINISHED, STOPPED = "failed", "finished", "interrupted"
# Posted for a rank by a peer on its machine, which found its process ended without a post
# (os._exit, a signal); the host is the rank's.
VANISHED = "vanished"
# Posted by a rank that stops on a preemption, its ``why`` the step the ranks saved with it
# (checkpoint/preemption.py): no failure, and an elastic job's peers go on without it.
PREEMPTED = "preempted"
# The ``why`` of a finish posted by the at-exit shutdown: the script ended, or called
# ``sys.exit(n)`` with a code no hook sees. Only the launcher's record (or none) tells which.
AT_EXIT = "at exit"
E = TypeVar("E", bound=BaseException)


@dataclass(frozen=True)
class Departure:
    """One rank's record of how it left."""

    rank: int
    how: str  # FAILED, FINISHED, STOPPED (the job was interrupted), PREEMPTED or VANISHED
    why: str  # "ValueError: boom" for a failure; "" for a finish; what interrupted the job
    host: str
    at: float  # time.time() on the departed rank's host

    def describe(self) -> str:
        who = f"rank {self.rank} (host {self.host})" if self.host else f"rank {self.rank}"
        if self.how == FAILED:
            return f"{who} failed: {self.why}"
        if self.how == STOPPED:
            return f"{who} left: {self.why}"
        if self.how == PREEMPTED:
            return f"{who} stopped on a preemption at step {self.why}, saved with this rank"
        if self.how == VANISHED:
            return (
                f"{who} ended without a word (os._exit, or killed by a signal) while this rank "
                "still waited for it"
            )
        if self.why and self.why != AT_EXIT:  # the launcher's record: no shutdown ran
            return f"{who} {self.why} while this rank still waited for it"
        if self.why == AT_EXIT:  # no exit code recorded (torchrun, mpirun, Slurm)
            return (
                f"{who} left without an exception: its script "
                "ended or called sys.exit(), with an exit code this rank cannot see, while this "
                "rank still waited for it"
            )
        return (
            f"{who} finished: its script ended or called "
            "ringtrain.shutdown() while this rank still waited for it"
        )

    def encode(self) -> str:
        return json.dumps(
            {"rank": self.rank, "how": self.how, "why": self.why, "host": self.host, "at": self.at}
        )

    @staticmethod
    def decode(raw: bytes | str) -> Departure:
        d = json.loads(raw)
        return Departure(
            int(d["rank"]), str(d["how"]), str(d["why"]), str(d["host"]), float(d["at"])
        )


class _Where:
    """Where this process posts: the running world's store and this rank's number in it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.store: Store | None = None
        self.notes = PLAIN  # the world's: a failure's words are sealed in secure mode
        self.rank = -1
        self.host = ""
        self.failure: str | None = None  # set by the except hook: this process is failing
        self.posted = False


_here = _Where()
_Hook = Callable[[type[BaseException], BaseException, TracebackType | None], object]
_previous_hook: _Hook | None = None


def bind(store: Store | None, rank: int, host: str, notes: Notes = PLAIN) -> None:
    """Post to ``store`` as world ``rank`` from now on (``ringtrain.init``), sealed by ``notes``;
    installs the hook that records an uncaught exception, once per process."""
    global _previous_hook
    with _here.lock:
        _here.store, _here.rank, _here.host, _here.posted = store, rank, host, False
        _here.notes = notes
    processes.say_present(store, rank, host, notes)
    if _previous_hook is None:
        _previous_hook = sys.excepthook
        sys.excepthook = _on_uncaught


def _vanished_here(store: Store, ranks: Sequence[int], patient: bool) -> list[Departure]:
    """Ranks that left without a post (where no launcher records ends): posted as ended by a
    peer that looked, or found ended here (a process on this machine ended; the door of one on
    another machine refused a knock, see :mod:`~ringtrain.runtime.processes`), and then posted
    as such for the others. ``patient``: waited for a wait that broke as a process closed its
    sockets (not for one that timed out), up to :data:`VANISH_WAIT_S`, or :data:`TOLD_WAIT_S`
    where some of ``ranks`` ran on other machines."""
    try:
        client = _client(store, datetime.timedelta(seconds=READ_TIMEOUT_S))
        start, known, knocked = time.monotonic(), {}, -KNOCK_EVERY_S  # type: float, Known, float
        posted, looks = -1, 0
        while True:
            # First: a rank that ended after a peer is no cause. Read again only when a post
            # came (one request a look, not one per rank: every peer of a large job looks).
            count = client.add(POSTED, 0)
            if count != posted:
                posted, told = count, _posts(client, ranks)
                if told:
                    return told
            here = processes.ended(client, ranks, _here.notes, known)
            ended = [r for r, done in here.items() if done]
            away = processes.elsewhere(ranks, known)
            if not ended and away and time.monotonic() - knocked >= KNOCK_EVERY_S:
                knocked, looks = time.monotonic(), looks + 1
                ended = processes.knock(away, known, (_here.rank + looks) * processes.KNOCK_MAX)
            if ended:
                return [_post_vanished(client, r, known) for r in ended]
            limit = (TOLD_WAIT_S if away else VANISH_WAIT_S) if patient else 0.0
            if not (here or away) or time.monotonic() - start >= limit:
                return []
            time.sleep(0.05)
    except Exception as e:  # the store left with the rank that served it
        log.debug("could not read which processes the ranks are: %s", e)
        return []


def _post_vanished(client: Store, rank: int, known: Known) -> Departure:
    """Post that ``rank`` ended without a word; a post of its own, or another peer's, stays
    (``compare_set`` sets only a key not there)."""
    host = known[rank].host if rank in known else ""
    d = Departure(rank, VANISHED, "", host or _here.host or socket.gethostname(), time.time())
    key = PREFIX + str(rank)
    try:
        sealed = _here.notes.seal(key, d.encode().encode())
        if bytes(client.compare_set(key, "", sealed)) == sealed:  # type: ignore[arg-type]
            client.add(POSTED, 1)
    except Exception as e:
        log.debug("could not post that rank %d ended: %s", rank, e)
    return d


def _posts(client: Store, ranks: Sequence[int]) -> list[Departure]:
    """The departures of ``ranks`` posted now, as posted."""
    keys = [PREFIX + str(r) for r in ranks]
    return [
        Departure.decode(_here.notes.open(k, bytes(client.get(k))))
        for k in keys
        if client.check([k])
    ]


def unbind() -> None:
    """The world is gone (shutdown, elastic re-forming): nothing more to post to it."""
    with _here.lock:
        _here.store = None


def failure() -> str | None:
    """This process's uncaught exception, as posted (``"ValueError: boom"``); None if none."""
    return _here.failure


def summary(exc: BaseException) -> str:
    """``Type: message`` on one line, at most 300 characters: what a peer's error quotes."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _on_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """sys.excepthook: post the failure first (the traceback printing and the at-exit work come
    after, and the peers are waiting now), then let the previous hook print as usual."""
    try:
        if not issubclass(kind, KeyboardInterrupt):
            _here.failure = summary(exc)
            _tell(exc, _here.failure)
        else:  # Ctrl-C: nothing failed (the launcher's record, if any, names the signal)
            post(STOPPED, f"{INTERRUPTED} (KeyboardInterrupt)")
    except Exception:  # the hook must print the user's traceback whatever happens here
        log.debug("could not post this rank's failure", exc_info=True)
    hook = _previous_hook if _previous_hook is not None else sys.__excepthook__
    hook(kind, exc, tb)


def raising() -> str | None:
    """The exception this thread is raising or handling now, told as a failure: for a
    ``shutdown()`` that runs in a ``finally:`` or ``except:`` block (``try: train() finally:
    hvd.shutdown()``), before the except hook could see it. Its peers then quote it, as they quote
    an uncaught one, instead of hearing that the rank's script ended. None outside such a block,
    and for what is not an ``Exception`` (``SystemExit``: the exit code tells;
    ``KeyboardInterrupt``, as the hook). Not kept as :func:`failure`: the process may go on."""
    exc = sys.exc_info()[1]
    if not isinstance(exc, Exception):
        return None
    why = summary(exc)
    try:
        _tell(exc, why)
    except Exception:  # telling is best effort; the shutdown must go on
        log.debug("could not post this rank's failure", exc_info=True)
    return why


def _tell(exc: BaseException, why: str) -> None:
    if _after_a_peer(exc):  # not a cause: the peer that left posted its own words
        heartbeat.say(heartbeat.FAILING_AFTER_PEER)
    else:
        heartbeat.say(heartbeat.FAILING)  # the launcher's root cause goes by this time
        post(FAILED, why)


def _after_a_peer(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer left first (a wait that broke on its departure)."""
    if isinstance(exc, CollectiveAbortedError):
        return True
    # Raw Gloo errors from waits outside ringtrain's (a script's own torch.distributed calls).
    return isinstance(exc, RuntimeError) and "gloo/transport" in str(exc)


def post(how: str, why: str = "") -> None:
    """Post this rank's departure, once per world; never raises (the store may be gone)."""
    with _here.lock:
        store, rank = _here.store, _here.rank
        if store is None or _here.posted:
            return
        _here.posted = True
    host = _here.host or socket.gethostname()
    record = Departure(rank, how, why, host, time.time())
    try:
        key = PREFIX + str(rank)
        store.set(key, _here.notes.seal(key, record.encode().encode()))  # type: ignore[arg-type]
        store.add(POSTED, 1)
    except Exception as e:
        log.debug("could not post that rank %d %s: %s", rank, how, e)


def read(
    store: Store | None, ranks: Sequence[int], timeout_s: float = READ_TIMEOUT_S
) -> list[Departure]:
    """The posts of ``ranks`` that exist now, failures first, then by time."""
    if store is None:
        return []
    found: list[Departure] = []
    try:
        client = _client(store, datetime.timedelta(seconds=timeout_s))
        found = _posts(client, ranks)
        if any(d.how not in _OWN_WORD for d in found):
            records = _launcher_store(client)
            records.set_timeout(datetime.timedelta(seconds=timeout_s))
            deadline = time.monotonic() + (EXIT_WAIT_S if _launcher_records_exits() else 0.0)
            found = [_with_exit_code(records, d, deadline) for d in found]
    except Exception as e:  # the store left with a failed rank: the caller says what it has
        log.debug("could not read the departures: %s", e)
    return sorted(found, key=lambda d: (d.how != FAILED, d.at))


def _client(store: Store, timeout: datetime.timedelta) -> Store:
    """A client of ``store`` of its own (the job's may be busy in another thread's wait), with
    ``timeout``. The clone connects within ``timeout`` too: where the store's server died with
    rank 0, a clone retried for the job's whole timeout_s (minutes) before the read gave up."""
    clone, kept = getattr(store, "clone", None), getattr(store, "timeout", None)
    if clone is None or kept is None:
        store.set_timeout(timeout)
        return store
    store.set_timeout(timeout)  # read by the clone's connect; restored at once
    try:
        client: Store = clone()
    finally:
        store.set_timeout(kept)
    client.set_timeout(timeout)
    return client


def _launcher_records_exits() -> bool:
    """Whether ``ringtrain run`` started this rank in a fixed world: its launcher records each
    rank's exit code (:func:`ringtrain.launch.failures.exited_key`)."""
    env = environ.current()
    return bool(env.get(heartbeat.VAR)) and not env.get(Ringtrain.ELASTIC_ID)


def _launcher_store(store: Store) -> Store:
    """The store under the job's prefixes (torch's ``PrefixStore``), where the launcher writes."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _with_exit_code(client: Store, d: Departure, deadline: float) -> Departure:
    """A "finished" (or interrupted) post with the launcher's record of the rank's exit code,
    waited for until ``deadline``: Python tells no at-exit hook the code of ``sys.exit(n)``
    (SystemExit never reaches ``sys.excepthook``), so the rank posted that it finished; its
    launcher saw the code, and whether the rank ended on a signal the launcher forwarded."""
    if d.how in _OWN_WORD:
        return d
    key = exited_key(d.rank)
    while not client.check([key]):
        if time.monotonic() >= deadline:
            return d
        time.sleep(0.02)
    how = bytes(client.get(key)).decode()
    if how == "exited with code 0":  # known now: a finish, whether it posted at exit or not
        return Departure(d.rank, FINISHED, "", d.host, d.at)
    if how.startswith(INTERRUPTED):
        return Departure(d.rank, STOPPED, how, d.host, d.at)
    if how.startswith("exited with code"):  # not for a signal: no sys.exit gives one
        how += " without an exception (sys.exit or os._exit; its launcher saw the code)"
    return Departure(d.rank, FAILED, how, d.host, d.at)


# Posts that say how the rank ends, which no exit code recorded later can tell better.
_OWN_WORD = (FAILED, PREEMPTED)


def _unposted(store: Store, ranks: Sequence[int]) -> list[Departure]:
    """Ranks that left without a post (``os._exit(5)``, a signal), as ``ringtrain run``
    recorded their ends, waited for up to :data:`UNPOSTED_WAIT_S`: the wait broke when the
    process was gone, and its agent reaps and reports it moments later. Else Gloo's "Connection
    closed by peer" was all the peer could say. No host: the record does not carry one."""
    found: list[Departure] = []
    try:
        client = _launcher_store(_client(store, datetime.timedelta(seconds=READ_TIMEOUT_S)))
        deadline = time.monotonic() + UNPOSTED_WAIT_S
        while not found and time.monotonic() < deadline:
            for r in ranks:
                if client.check([exited_key(r)]):
                    how = bytes(client.get(exited_key(r))).decode()
                    kind = _recorded_how(how)
                    why = (
                        f"{how} without leaving the job (os._exit(0)?)" if kind == FINISHED else how
                    )
                    found.append(Departure(r, kind, why, "", time.time()))
            time.sleep(0.05)
    except Exception as e:  # the store left with the launcher: the caller says what it has
        log.debug("could not read the launcher's records: %s", e)
    return sorted(found, key=lambda d: d.how != FAILED)


def reader(store: Store) -> Store:
    """A client of ``store`` of its own for :func:`gone`, each wait bounded by
    :data:`READ_TIMEOUT_S` (raises if the store cannot be reached)."""
    return _client(store, datetime.timedelta(seconds=READ_TIMEOUT_S))


def gone(
    client: Store, ranks: Sequence[int], known: Known | None = None
) -> dict[int, tuple[str, bool]]:
    """Those of ``ranks`` known to be gone, for one that waits for what they were to write (a
    checkpoint's parts): each with how it left and whether its process has ended, as ``ringtrain
    run`` recorded it (else it posted a failure, and its end comes moments later: a failing
    rank's at-exit work waits for nothing). A rank that posted only that it finished may still
    be in its at-exit work, which may be writing: it is named once its exit is recorded. Where
    no launcher records exits, a rank whose process is seen ended on this machine has ended,
    whether it posted or not (``os._exit``, a signal), and so is one a peer on its machine
    posted as such (:data:`VANISHED`). ``known``: the ranks' process posts read
    so far from ``client`` (a reader that asks again keeps them: each is read once).
    Raises what the store raises (``client``: see :func:`reader`)."""
    found: dict[int, tuple[str, bool]] = {}
    posts: dict[int, Departure] = {}
    known = {} if known is None else known
    records = _launcher_store(client) if _launcher_records_exits() else None
    for r in ranks:
        key = PREFIX + str(r)
        post = None
        if client.check([key]):
            post = posts[r] = Departure.decode(_here.notes.open(key, bytes(client.get(key))))
        ended = records is not None and records.check([exited_key(r)])
        if post is not None and post.how == FAILED:
            found[r] = (post.describe(), ended)
        elif post is not None and post.how == VANISHED:  # seen ended by a peer on its machine
            found[r] = (post.describe(), True)
        elif ended and records is not None:
            found[r] = (f"rank {r} {bytes(records.get(exited_key(r))).decode()}", True)
    # No launcher's record (torchrun, mpirun): a rank's process seen ended on this machine.
    rest = [r for r in ranks if not found.get(r, ("", False))[1]] if records is None else []
    for r, ended in processes.ended(client, rest, _here.notes, known).items():
        if ended:  # posted for the peers on other machines, where it said nothing
            d = posts[r] if r in posts else _post_vanished(client, r, known)
            found[r] = (d.describe(), True)
    return found


def _recorded_how(how: str) -> str:
    if how == "exited with code 0":
        return FINISHED
    return STOPPED if how.startswith(INTERRUPTED) else FAILED


def peer_error(cause: BaseException, waited_for: str = "") -> BaseException:
    """The error to raise for ``cause``, a wait on peers that broke: a :class:`PeerFailedError`
    naming the ranks that posted a departure (failures first), else ``cause`` itself."""
    from ringtrain.runtime import state

    if isinstance(cause, PeerFailedError) or not state.is_initialized():
        return cause
    rt = state.current()
    if rt.size <= 1:
        return cause
    store = state.global_process_set.communicator.store
    others = [r for r in range(rt.size) if r != rt.rank]
    gone = read(store, others)
    if not gone and store is not None and _launcher_records_exits():
        gone = _unposted(store, others)
    elif not gone and store is not None:  # a wait that timed out: no process is ending now
        gone = _vanished_here(store, others, patient="timed out" not in str(cause).lower())
    if not gone:
        return cause
    where = f" while this rank waited for it in {waited_for}" if waited_for else ""
    said = f"{type(cause).__name__}: {' '.join(unplaced(str(cause)).split())[:200]}"
    return _named(rt.rank, where, gone, f"  (this rank's wait ended with {said})")


_GLOO_WHERE = re.compile(r"\[[^\]\s]*/gloo/[^\]\s]*\] ")  # "[/.../gloo/.../pair.cc:537] "


def unplaced(text: str) -> str:
    """``text`` without Gloo's source locations, which say nothing to a user and push the
    reason after them past any cut."""
    return _GLOO_WHERE.sub("", text)


def _named(me: int, where: str, gone: list[Departure], ended: str) -> PeerFailedError:
    lines = [f"rank {me}: a peer left the job{where}: {gone[0].describe()}"]
    lines += [f"  also: {d.describe()}" for d in gone[1:]]
    lines.append(ended)
    # By the first departure, as the report names it first: what came after may be its doing.
    hints = {FAILED: _FAILED_HINT, STOPPED: _STOPPED_HINT, PREEMPTED: _PREEMPTED_HINT}
    hint = hints.get(gone[0].how, _FINISHED_HINT)
    unknown = gone[0].why == AT_EXIT or gone[0].how == VANISHED  # no exit code known here
    lines.append(_unknown_exit_hint(gone[0].rank) if unknown else hint)
    preempted = all(d.how == PREEMPTED for d in gone)
    return PeerFailedError("\n".join(lines), tuple(d.rank for d in gone), preempted=preempted)


_FAILED_HINT = "HINT: the first failure above is the cause; fix it and start the job again."
_FINISHED_HINT = f"HINT: no rank failed; {RAN_FEWER}"


def _unknown_exit_hint(rank: int) -> str:
    return (
        f"HINT: the exit code your launcher reports for rank {rank} tells: not 0 (sys.exit(n)), "
        f"that is the failure to fix; 0, no rank failed: {RAN_FEWER}"
    )


_STOPPED_HINT = (
    "HINT: no rank failed: the job was interrupted and its ranks are ending; this rank went on "
    "after the signal and found its peers gone."
)


_PREEMPTED_HINT = (
    "HINT: no rank failed: a rank stopped on a preemption at a step the ranks saved; an elastic "
    "job goes on without it, another resumes from that save (ringtrain run --resume)."
)


def with_exit_codes(error: E) -> E | PeerFailedError:
    """``error``, or, where it says only that peers left (a control round's vote carries no
    exit code), the failure their launcher saw: a rank that ended with ``sys.exit(3)`` failed.
    Read on the waiting thread, not the control round's: under ``ringtrain run`` it may wait
    up to :data:`EXIT_WAIT_S` for the record; elsewhere no one keeps one, and it does not wait
    (a rank that left at exit is then named as one whose exit code this rank cannot see)."""
    from ringtrain.runtime import state

    if not (isinstance(error, PeerFailedError) and error.exits_unread):
        return error
    settled = PeerFailedError(str(error), error.ranks)  # read once, whatever it finds
    if not state.is_initialized():
        return settled
    gone = read(state.global_process_set.communicator.store, list(error.ranks))
    if all(d.how == FINISHED and d.why != AT_EXIT for d in gone):
        return settled
    ended = "  (this rank's collective ended when it left, before it completed)"
    return _named(state.current().rank, "", gone, ended)


def again(error: BaseException) -> BaseException:
    """A fresh copy of a collective's ``error`` for each caller that raises it, so that its
    traceback points at that caller (a handle's error may be raised to several)."""
    if isinstance(error, PeerFailedError):
        return PeerFailedError(str(error), error.ranks, error.exits_unread, error.preempted)
    if isinstance(error, CollectiveError):
        return type(error)(*error.args)
    return error
