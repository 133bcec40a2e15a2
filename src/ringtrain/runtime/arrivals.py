"""Every rank's arrival in ``init()``, awaited before the first process group waits on it.

Without this, the ranks that called ``init()`` wait in Gloo's first connection for a rank that
never calls it, silently for the whole ``timeout_s``, and then fail with torch's store timeout,
which names a store key, not a rank. Instead each rank posts ``arrived/<rank>`` under the
world's store prefix, and waits for every rank's post:

- a rank that the launcher saw exit before it arrived (``ringtrain run`` records how each rank's
  process ended in the store: :data:`ringtrain.launch.failures.EXITED_PREFIX`) ends the wait at
  once with :class:`MissingRanksError`, naming it and how it ended ("exited with code 0");
- past :data:`SAY_AFTER_S` the lowest waiting rank logs which ranks are missing, every
  :data:`SAY_EVERY_S`;
- past ``timeout_s``: :class:`MissingRanksError` naming the ranks that never arrived;
- in an elastic job, a newer world announced by the launcher (a rank was lost before it
  arrived) ends the wait with :class:`WorldSuperseded`: the caller joins that world instead.

A secure rank's arrival says so (and counts itself in ``arrived-secure``): once all arrived,
every rank compares that count with the world's size, and where some ranks are secure and some
not (a wrapper that dropped ``--secure`` for one rank), every rank raises a
:class:`~ringtrain.errors.SecurityError` naming them, at once. Without it the secure ranks wait
the whole timeout for a proof of the key that a plain rank never gives, and blame the key.

The wait polls with ``check`` (which never waits): a TCPStore ``wait`` that times out logs two
c10d warnings, every slice.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch.distributed as dist

from ringtrain.config import Config
from ringtrain.errors import CollectiveAbortedError, MissingRanksError, SecurityError, by_rank
from ringtrain.launch.failures import exited_key
from ringtrain.runtime import seats
from ringtrain.runtime.contracts import Store
from ringtrain.runtime.environment import Placement, job_id

log = logging.getLogger("ringtrain")

PREFIX, COUNT, SECURE_COUNT = "arrived/", "arrived", "arrived-secure"
SECURE = "secure"  # a secure rank's arrival post (a plain rank's is "1")
SAY_AFTER_S, SAY_EVERY_S = 10.0, 30.0
# How often, and for how many ranks at most, the arrivals and the launcher's exit records of
# the ranks not seen yet are read.
LOOK_EVERY_S, LOOK_AT_MOST = 0.5, 32


class WorldSuperseded(CollectiveAbortedError):
    """The launcher announced a newer world while this one was gathering: join that one. Also
    raised by a wait of this world's groups (:mod:`.watched_store`), where later it means the
    peer failed that a collective waits for."""


def world_store(
    prefix: str,
    base: dist.Store,
    p: Placement,
    config: Config,
    adopted: bool,
    superseded: Callable[[], bool] | None = None,
    env: Mapping[str, str] | None = None,
) -> dist.Store:
    """The world's store (``base`` under ``prefix``), once every rank of ``p``'s world posted
    its arrival in it (:func:`wait_for_all`). Ranks of an adopted group are numbered by the
    script's group, not the launcher: its exit records are not read then. ``env``: the
    launcher's variables, for its job id (:func:`.environment.job_id`)."""
    store = dist.PrefixStore(prefix, base)
    records = None if adopted else base
    job = job_id(env or {}) or ""
    where = f"{p.rendezvous_addr}:{p.rendezvous_port}"
    wait_for_all(
        store, p.rank, p.size, config.timeout_s, records, superseded, config.secure, job, where
    )
    return store


def wait_for_all(
    store: dist.Store,
    rank: int,
    size: int,
    timeout_s: float,
    records: Store | None = None,
    superseded: Callable[[], bool] | None = None,
    secure: bool = False,
    job: str = "",
    where: str = "the rendezvous store",
) -> None:
    """Post this rank's arrival in ``store`` (the world's prefix) and wait for every rank's.

    ``records``: the store where the launcher records how ranks' processes ended (the job's
    store without the world's prefix; None where ranks are not numbered as the launcher numbers
    them). ``superseded``: whether a newer world was announced (elastic jobs), asked at each
    look; True raises :class:`WorldSuperseded`. ``secure``: this rank is in secure mode; all
    ranks must be, or none (:func:`_same_mode`). ``job`` and ``where``: the launcher's job id
    ("" where it has none) and the rendezvous address; the arrival is this process's seat
    (:mod:`.seats`: one process per rank, one world size, one job).
    """
    if size <= 1:
        return
    seat = seats.Seat(store, PREFIX + str(rank), rank, size, job, where, SECURE if secure else "1")
    seated = seat.take()  # rank 0's at once; another's once rank 0 posted its world
    # A count to poll (one request, whatever the size); the keys say who is missing.
    arrived = _arrive(store, secure) if seated else store.add(COUNT, 0)
    start = time.monotonic()
    deadline, say_at, look_at = start + timeout_s, start + SAY_AFTER_S, start + LOOK_EVERY_S
    # Short polls while the world gathers (a rank late by milliseconds costs milliseconds),
    # longer ones in big worlds, so that N waiting ranks do not flood the store's server.
    pause, longest = 0.002, min(1.0, 0.05 * max(1, size // 64))
    unseen = collections.deque(r for r in range(size) if r != rank)
    while not seated or arrived < size:
        time.sleep(pause)
        pause = min(pause * 2, longest)
        if not seated and seat.take():
            seated, arrived = True, _arrive(store, secure)
        else:
            arrived = store.add(COUNT, 0)
        now = time.monotonic()
        if (seated and arrived >= size) or now < look_at:
            continue
        look_at = now + LOOK_EVERY_S
        if superseded is not None and superseded():
            raise WorldSuperseded(f"rank {rank}: a newer world was announced ({arrived}/{size})")
        # A window of the ranks not seen yet, in turn: a look costs the same at any size.
        window = [unseen.popleft() for _ in range(min(LOOK_AT_MOST, len(unseen)))]
        still = [r for r in window if not _arrived(store, r)]
        unseen.extend(still)
        _fail_if_exited(records, rank, size, arrived, still)
        missing = _missing(store, unseen) if now >= deadline else []
        if missing:
            raise MissingRanksError(_never_arrived(rank, size, missing, timeout_s), (*missing,))
        if now >= say_at and _says(store, rank):
            say_at = now + SAY_EVERY_S
            log.warning(
                "rank %d: init() is still waiting for rank(s) %s to call ringtrain.init() "
                "(%.0f s so far; giving up after timeout_s=%g s)",
                rank,
                _names(_missing(store, unseen)),
                now - start,
                timeout_s,
            )
    _same_mode(store, rank, size)


def _arrive(store: dist.Store, secure: bool) -> int:
    """Count this rank's arrival (seated); the count of arrivals so far."""
    if secure:  # counted before the arrival: complete once every rank has arrived
        store.add(SECURE_COUNT, 1)
    return store.add(COUNT, 1)


def _same_mode(store: dist.Store, rank: int, size: int) -> None:
    """Raise on every rank where some ranks arrived in secure mode and some did not (one read
    where all agree; the ranks' posts only to name them)."""
    secure = store.add(SECURE_COUNT, 0)
    if secure in (0, size):
        return
    modes = [
        "secure" if seats.mode(bytes(store.get(PREFIX + str(r)))) == SECURE else "not secure"
        for r in range(size)
    ]
    raise SecurityError(
        f"rank {rank}: {secure} of {size} ranks started in secure mode, the others without it:\n"
        + "\n".join(by_rank(modes))
        + "\nHINT: start every rank of a secure job in secure mode (ringtrain run --secure, or "
        "RINGTRAIN_SECURE=1 and the same RINGTRAIN_KEY_FILE on every rank); a wrapper script "
        "or launcher that drops the variables for some ranks does this."
    )


def _arrived(store: Store, r: int) -> bool:
    return store.check([PREFIX + str(r)])


def _missing(store: Store, unseen: Iterable[int]) -> list[int]:
    return sorted(r for r in unseen if not _arrived(store, r))


def _says(store: Store, rank: int) -> bool:
    """Whether ``rank`` is the lowest rank that arrived: the one that logs who is missing."""
    return next(r for r in range(rank + 1) if r == rank or _arrived(store, r)) == rank


def _fail_if_exited(
    records: Store | None, rank: int, size: int, arrived: int, missing: Sequence[int]
) -> None:
    """Raise :class:`MissingRanksError` if the launcher recorded that a ``missing`` rank ended
    (its process exited before it arrived)."""
    if records is None or not missing:
        return
    ended: dict[int, str] = {}
    try:  # check first: get() would wait for a key that is not there
        for r in missing:
            if records.check([exited_key(r)]):
                ended[r] = bytes(records.get(exited_key(r))).decode()
    except Exception as e:  # the launcher's store is going away: the timeout still holds
        log.debug("could not read the launcher's exit records: %s", e)
    if not ended:
        return
    first, how = next(iter(ended.items()))
    also = "".join(f"; rank {r} {h}" for r, h in list(ended.items())[1:])
    raise MissingRanksError(
        f"rank {rank}: rank {first} {how} before it called ringtrain.init(){also}, so this "
        f"rank's init() can never complete ({arrived} of {size} ranks arrived).\n"
        f"HINT: every rank must call ringtrain.init() (hvd.init()) before it ends; rank "
        f"{first}'s own output says why it ended first (a branch that skips init, an early "
        "sys.exit or return).",
        tuple(ended),
    )


def _never_arrived(rank: int, size: int, missing: Sequence[int], timeout_s: float) -> str:
    return (
        f"rank {rank}: rank(s) {_names(missing)} did not call ringtrain.init() within "
        f"timeout_s={timeout_s:g} s ({size - len(missing)} of {size} ranks arrived).\n"
        "HINT: every rank must call ringtrain.init() (hvd.init()); the missing ranks' own "
        "output says where they are (stuck before init, or still loading). A start slower than "
        "that needs a larger timeout (ringtrain run --timeout S, RINGTRAIN_TIMEOUT_S)."
    )


def _names(ranks: Sequence[int], most: int = 16) -> str:
    """``[1, 5]``, or the first ``most`` and how many in all."""
    if len(ranks) <= most:
        return str(list(ranks))
    return f"[{', '.join(map(str, ranks[:most]))}, ...] ({len(ranks)} in all)"
