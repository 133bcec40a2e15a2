"""The rank's side of the launcher's membership announcements, read from the rendezvous store.

``ringtrain run --min-np N`` gives each rank a stable identity (``RINGTRAIN_ELASTIC_ID``, its
first rank) and, when ranks leave, announces a new world in the store it serves:

* ``ringtrain/elastic/members/<g>``: the identities of world ``g``, in new-rank order;
* ``ringtrain/elastic/generation``: the newest ``g`` (written after its member list).

A rank whose collective failed sets ``ringtrain/elastic/reform/<g>/<identity>``
(:func:`ask_reform`): where no rank left, the launcher re-forms world ``g``'s ranks as ``g + 1``.

The launcher is the one authority on generations, so survivors agree on the new world and its
store prefix whatever each one saw of the failure. Generation 0 is the world the job started as.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ringtrain import environ
from ringtrain.environ import Ringtrain
from ringtrain.errors import HorovodInternalError
from ringtrain.launch.elastic import (
    GENERATION_KEY,
    ID_VAR,
    JOIN_VAR,
    RESET_LIMIT_VAR,
    TIMEOUT_VAR,
    members_key,
    ready_key,
    reform_key,
)
from ringtrain.runtime import abort
from ringtrain.runtime.contracts import Store

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Roster:
    """One generation of the elastic world: its number and its members."""

    generation: int
    members: tuple[int, ...]  # identities, in new-rank order


_clients = threading.local()  # one store client per thread: waits poll from several
_current = 0  # the generation this process runs in
_members: tuple[int, ...] | None = None  # its identities; None: the first world (0..size-1)


def active(env: Mapping[str, str] | None = None) -> bool:
    """Whether an elastic launcher started this rank."""
    return ID_VAR in (environ.current() if env is None else env)


def identity() -> int:
    return int(environ.current()[ID_VAR])


def timeout_s() -> float:
    return float(environ.current().get(TIMEOUT_VAR) or DEFAULT_TIMEOUT_S)


def reset_limit() -> int | None:
    raw = environ.current().get(RESET_LIMIT_VAR)
    return int(raw) if raw else None


def current() -> int:
    return _current


def _store() -> Store:
    client = getattr(_clients, "store", None)
    if client is None:
        import torch.distributed as dist

        client = _clients.store = dist.TCPStore(
            environ.current()[Ringtrain.RENDEZVOUS_ADDR],
            int(environ.current()[Ringtrain.RENDEZVOUS_PORT]),
            world_size=None,
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
            wait_for_workers=False,
            use_libuv=True,
        )
    return client


def announced() -> int | None:
    """The newest generation the launcher announced; ``None`` outside an elastic job."""
    if not active():
        return None
    store = _store()
    if not store.check([GENERATION_KEY]):
        return 0
    return int(store.get(GENERATION_KEY))


def newest() -> int:
    """The newest generation announced (0 outside elastic jobs)."""
    return announced() or 0


def ask_reform() -> None:
    """Ask the launcher to re-form this world: a collective failed here. Where no rank left
    (this rank's own connection broke, or a peer's that stays), no other event would bring a new
    world; where one left, the launcher's world without it comes first and this request lapses."""
    _store().set(reform_key(_current, identity()), "1")


def next_world(wait_s: float | None = None, failed: bool = True) -> Roster:
    """Wait (at most ``wait_s``, default the elastic timeout) for a world newer than ours;
    ``failed``: a collective failed (else a ``HostsUpdatedInterrupt`` was raised).

    Raises :class:`HorovodInternalError` when none is announced in time: the failure was not one
    the launcher saw (no rank left), so re-forming cannot help.
    """
    wait_s = timeout_s() if wait_s is None else wait_s
    store = _store()
    try:
        store.wait([members_key(_current + 1)], datetime.timedelta(seconds=wait_s))
    except Exception as e:  # the store's timeout error has no stable type across torch versions
        what = (
            "a collective failing"
            if failed
            else "HostsUpdatedInterrupt (raised by a state's commit() or check_host_updates(), "
            "or by the script itself)"
        )
        raise HorovodInternalError(
            f"no new world was announced within {wait_s:.0f} s of {what} (this process is in "
            f"generation {_current}).\nHINT: the launcher announces one when a rank exits, the "
            "hosts change, or a rank asks after a failed collective (every rank whose collective "
            "failed asks); is the launcher still running?"
            + (" The error that started this is chained below." if failed else "")
        ) from e
    return announced_world()


def announced_world() -> Roster:
    """The newest world the launcher announced (one was: ``announced()`` is above 0)."""
    store = _store()
    generation = int(store.get(GENERATION_KEY))
    members = json.loads(store.get(members_key(generation)))
    return Roster(generation, tuple(int(m) for m in members))


def superseded_since() -> Callable[[], bool]:
    """Whether the launcher announced a world newer than the one this process runs in now,
    asked later too, after the process moved on (a group of that world may still ask, from one
    of its threads)."""
    mine = _current
    return lambda: (announced() or 0) > mine


def members(size: int) -> tuple[int, ...]:
    """The identities of the world this process runs in (``size``: that world's size)."""
    return _members if _members is not None else tuple(range(size))


def joining() -> bool:
    """Whether the launcher started this rank to join a job that is already running."""
    return active() and environ.current().get(JOIN_VAR) == "1"


def join(poll_s: float = 0.1) -> Roster:
    """A joining rank: say it is ready, then wait for the first world that holds it.

    The launcher announces the world only once every new rank of a host is ready, so the
    running ranks never wait in a rendezvous for a rank that is still importing its modules.
    """
    me = identity()
    store = _store()
    store.set(ready_key(me), "1")
    deadline = time.monotonic() + timeout_s()
    while True:
        generation = int(store.get(GENERATION_KEY)) if store.check([GENERATION_KEY]) else 0
        if generation > 0:
            ids = tuple(int(m) for m in json.loads(store.get(members_key(generation))))
            if me in ids:
                environ.pop(JOIN_VAR)  # joined: a later init is not a join again
                world = Roster(generation, ids)
                entered(world)
                return world
        if time.monotonic() > deadline:
            raise HorovodInternalError(
                f"rank {me} was started to join the running job but no world holding it was "
                f"announced within {timeout_s():.0f} s"
            )
        time.sleep(poll_s)


def entered(world: Roster) -> None:
    """Record that this process now runs in ``world``."""
    global _current, _members
    _current = world.generation
    _members = world.members
    abort.generation = world.generation
