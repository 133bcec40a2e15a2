"""Which process each rank is, posted at ``init()`` for a peer on its machine to see it end.

Where no launcher records how a rank ended (torchrun, mpirun), a rank that left without a word
(``os._exit``, a signal) is known only to a peer that sees its process: the same kernel (boot
id) and pid namespace. Each rank posts its pid and start time under :data:`PRESENT`; such a peer
finds the pid ended, a zombie, or reused by a younger process.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import psutil

from ringtrain.runtime.contracts import Store
from ringtrain.security.notes import Notes

log = logging.getLogger("ringtrain")

PRESENT = "ringtrain/present/"


def machine() -> str:
    """Which processes this one sees: the kernel's boot id and its pid namespace ("" unknown).
    A peer with the same can tell from a pid whether a rank's process still runs."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def say_present(store: Store | None, rank: int, notes: Notes) -> None:
    """Post which process this rank is (:data:`PRESENT`); best effort."""
    mine = machine()
    if store is None or not mine:
        return
    key = PRESENT + str(rank)
    try:  # never fails init(): a /proc that psutil cannot read (an enclave's) posts nothing
        me = psutil.Process()
        record = json.dumps({"machine": mine, "pid": me.pid, "started": me.create_time()})
        store.set(key, notes.seal(key, record.encode()))  # type: ignore[arg-type]
    except Exception as e:
        log.debug("could not post which process rank %d is: %s", rank, e)


# What ranks posted of their processes, as a reader keeps it: (pid, start time) on this
# machine, None elsewhere. A post never changes in its world.
Known = dict[int, "tuple[int, float] | None"]


def ended(
    client: Store, ranks: Sequence[int], notes: Notes, known: Known | None = None
) -> dict[int, bool]:
    """Those of ``ranks`` whose process ran on this machine, each with whether it has ended (a
    zombie included: its launcher has not reaped it yet). ``known``: the posts read so far
    from ``client``'s world, read once each (a reader that asks every second keeps them)."""
    mine, out = machine(), {}
    known = {} if known is None else known
    for r in ranks if mine else ():
        if r not in known:
            key = PRESENT + str(r)
            if not client.check([key]):
                continue  # not posted (yet): asked again next time
            seen = json.loads(notes.open(key, bytes(client.get(key))))
            here = seen.get("machine") == mine
            known[r] = (int(seen["pid"]), float(seen["started"])) if here else None
        process = known[r]
        if process is None:
            continue
        try:
            proc = psutil.Process(process[0])
            out[r] = (
                abs(proc.create_time() - process[1]) > 0.5  # the pid was reused
                or proc.status() == psutil.STATUS_ZOMBIE
            )
        except psutil.NoSuchProcess:
            out[r] = True
        except psutil.Error:  # not ours to look at: say nothing
            continue
    return out
