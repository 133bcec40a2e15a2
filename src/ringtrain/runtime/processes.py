"""Which process each rank is, posted at ``init()``, for a peer to tell that it ended.

Where no launcher records how a rank ended (torchrun, mpirun), a rank that left without a word
(``os._exit``, a signal) is known only to a peer that can look. Each rank posts, under
:data:`PRESENT`:

- its pid and start time, with the machine's boot id and pid namespace: a peer that sees the
  same processes finds the pid ended, a zombie, or reused by a younger process (:func:`ended`);
- a door: a TCP socket it listens on and never accepts from. The kernel answers a connect to
  it for as long as the process lives, whatever the process is doing; once the process is gone
  the port refuses (:func:`refused`). A peer on another machine knocks there. A refused knock
  says the process ended on a machine that is up; no answer (a machine or network down, a full
  backlog) says nothing, and nothing is concluded from it.

The door is closed in a forked child (a DataLoader worker, a writer), which must not hold it
open for a rank that died, and when the rank binds again (an elastic world re-formed).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import ipaddress
import json
import logging
import os
import selectors
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from ringtrain import environ
from ringtrain.environ import Torch
from ringtrain.host import network
from ringtrain.runtime.contracts import Store
from ringtrain.security.notes import Notes

log = logging.getLogger("ringtrain")

PRESENT = "ringtrain/present/"
KNOCK_TIMEOUT_S = 0.5  # for a door's answer; a refusal comes in one round trip
BACKLOG = 1024  # knocks a live rank's door holds unaccepted (the kernel caps it at somaxconn)
KNOCK_MAX = 64  # doors one look knocks on, at most (each a socket of the knocker's, for a moment)


@dataclass(frozen=True)
class Process:
    """What a rank posted of its process."""

    machine: str  # boot id / pid namespace ("" unknown)
    host: str  # the rank's host, as the job names it
    pid: int
    started: float  # its create time
    door: tuple[str, int] | None  # address and port it listens on; None: none opened


# What ranks posted of their processes, as a reader keeps it (a post never changes in its world).
Known = dict[int, Process]


def machine() -> str:
    """Which processes this one sees: the kernel's boot id and its pid namespace ("" unknown).
    A peer with the same can tell from a pid whether a rank's process still runs."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


_door: list[socket.socket] = []  # this process's door, while it has one


def _close_door() -> None:
    while _door:
        with contextlib.suppress(OSError):
            _door.pop().close()


os.register_at_fork(after_in_child=_close_door)
# The door is open until the process ends; closed as the interpreter exits, before it collects
# what is left, which would warn of a socket never closed (ResourceWarning, in -X dev).
atexit.register(_close_door)


def _open_door(store: Store) -> tuple[str, int] | None:
    """A listening socket on this host's address for the job's traffic (the network the peers
    share); None where there is none to find or the socket cannot be made."""
    _close_door()
    host = _store_host(store)
    if not host:
        return None
    door = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:  # Gloo's interface where the job chose one, else the route toward the store
        addr = network.local_address(environ.current().get(Torch.GLOO_SOCKET_IFNAME, ""), host)
        door.bind((addr, 0))
        door.listen(BACKLOG)
    except Exception as e:  # no address to listen on: the peers cannot knock, that is all
        door.close()
        log.debug("could not open a door for the peers to knock on: %s", e)
        return None
    _door.append(door)
    return addr, int(door.getsockname()[1])


def _store_host(store: Store) -> str:
    """The host a TCPStore under ``store``'s wrappers (prefixes, a watched store) connects to."""
    inner: object = store
    for _ in range(8):
        host = getattr(inner, "host", None)
        if isinstance(host, str) and host:
            return host
        inner = getattr(inner, "underlying_store", None) or getattr(inner, "_inner", None)
        if inner is None:
            break
    return ""


def say_present(store: Store | None, rank: int, host: str, notes: Notes) -> None:
    """Post which process rank ``rank`` on ``host`` is (:data:`PRESENT`), opening its door;
    best effort."""
    mine = machine()
    if store is None or not mine:
        return
    key = PRESENT + str(rank)
    try:  # never fails init(): a /proc that psutil cannot read (an enclave's) posts nothing
        me = psutil.Process()
        record = {"machine": mine, "host": host, "pid": me.pid, "started": me.create_time()}
        record["door"] = _open_door(store)
        store.set(key, notes.seal(key, json.dumps(record).encode()))  # type: ignore[arg-type]
    except Exception as e:
        log.debug("could not post which process rank %d is: %s", rank, e)


def _read(client: Store, ranks: Sequence[int], notes: Notes, known: Known) -> None:
    """Read into ``known`` the posts of ``ranks`` not read yet (each once)."""
    for r in ranks:
        key = PRESENT + str(r)
        if r in known or not client.check([key]):
            continue  # read already, or not posted (yet): asked again next time
        seen = json.loads(notes.open(key, bytes(client.get(key))))
        door = seen.get("door")
        where = (str(door[0]), int(door[1])) if door else None
        host, pid, started = str(seen.get("host", "")), int(seen["pid"]), float(seen["started"])
        known[r] = Process(str(seen["machine"]), host, pid, started, where)


def ended(
    client: Store, ranks: Sequence[int], notes: Notes, known: Known | None = None
) -> dict[int, bool]:
    """Those of ``ranks`` whose process ran on this machine, each with whether it has ended (a
    zombie included: its launcher has not reaped it yet). ``known``: the posts read so far
    from ``client``'s world, read once each (a reader that asks every second keeps them)."""
    mine, out = machine(), dict[int, bool]()
    known = {} if known is None else known
    if not mine:
        return out
    _read(client, ranks, notes, known)
    for r in ranks:
        process = known.get(r)
        if process is None or process.machine != mine:
            continue
        try:
            proc = psutil.Process(process.pid)
            out[r] = (
                abs(proc.create_time() - process.started) > 0.5  # the pid was reused
                or proc.status() == psutil.STATUS_ZOMBIE
            )
        except psutil.NoSuchProcess:
            out[r] = True
        except psutil.Error:  # not ours to look at: say nothing
            continue
    return out


def elsewhere(ranks: Sequence[int], known: Known) -> list[int]:
    """Those of ``ranks`` posted as running on another machine."""
    mine = machine()
    return [r for r in ranks if r in known and known[r].machine != mine]


def window(ranks: Sequence[int], start: int) -> list[int]:
    """The :data:`KNOCK_MAX` of ``ranks`` from ``start`` on, wrapping: peers that start at
    their own rank times KNOCK_MAX knock on every door between them, each door a few times,
    where each knocking on all would take N squared connects."""
    if len(ranks) <= KNOCK_MAX:
        return list(ranks)
    first = start % len(ranks)
    return [*ranks[first:], *ranks[:first]][:KNOCK_MAX]


def knock(ranks: Sequence[int], known: Known, start: int = 0) -> list[int]:
    """Those of ``ranks`` (on other machines: :func:`elsewhere`) whose door refused a knock, in
    the :func:`window` from ``start``. A door on a loopback address is not knocked on: from
    another machine that address is the knocker's own, whose refusal says nothing of the rank."""
    doors = {}
    for r in window(ranks, start):
        door = known[r].door if r in known else None
        if door is not None and _knockable(door[0]):
            doors[r] = door
    return refused(doors) if doors else []


def _knockable(address: str) -> bool:
    return not ipaddress.ip_address(address).is_loopback


def refused(doors: dict[int, tuple[str, int]], timeout_s: float = KNOCK_TIMEOUT_S) -> list[int]:
    """Those ranks whose door refused a knock: their process is gone. All knocked at once."""
    out: list[int] = []
    with selectors.DefaultSelector() as waiting:
        try:
            for rank, where in doors.items():
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                said = s.connect_ex(where)
                if said == errno.EINPROGRESS:
                    waiting.register(s, selectors.EVENT_WRITE, rank)
                    continue
                if said == errno.ECONNREFUSED:
                    out.append(rank)
                s.close()  # answered (alive), or no route: nothing to wait for
            deadline = time.monotonic() + timeout_s
            while waiting.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in waiting.select(left):
                    knocked: socket.socket = key.fileobj  # type: ignore[assignment]
                    said = knocked.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if said == errno.ECONNREFUSED:
                        out.append(key.data)
                    waiting.unregister(knocked)
                    knocked.close()
        finally:
            for key in list(waiting.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]
    return sorted(out)
