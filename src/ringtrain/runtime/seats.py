"""One process per rank, one world size, one job: each rank's seat at the world's rendezvous.

Processes find each other by the rendezvous address alone (``MASTER_ADDR:MASTER_PORT``). Two
processes given the same ``RANK``, ranks started for different world sizes, or a second job
started on the first one's address all reach one store, and torch's own rendezvous then fails
in Gloo's first connection ("Connection reset by peer") or waits out its timeout, naming none
of them. So, before a rank arrives (:mod:`.arrivals`):

- rank 0 takes its seat and posts the world it was started for (:data:`WORLD`: its size, and
  the launcher's job id where the launcher has one, :func:`.environment.job_id`);
- every other rank waits for that post, checks that the world is its own, and takes its seat:
  its arrival key, set only if no process holds it (``compare_set``), to this process's
  identity (host, pid and a nonce).

A rank that finds another job's world, another world size, or its seat taken raises
:class:`~ringtrain.errors.LaunchEnvironmentError` at once, naming both sides, and leaves the
job it met as it found it: it wrote nothing there. The seat holder and the job go on.
"""

from __future__ import annotations

import json
import os
import socket
import uuid

import torch.distributed as dist

from ringtrain.errors import LaunchEnvironmentError

WORLD = "world"  # rank 0's post: {"size": ..., "job": ...}


class Seat:
    """This process's seat ``key`` (its arrival key) in a world of ``size`` ranks, of launcher
    job ``job`` ("" where the launcher names none), at ``where`` (the rendezvous address, for
    the errors); the seat holds ``mode`` (the arrival's word) then who holds it."""

    def __init__(
        self, store: dist.Store, key: str, rank: int, size: int, job: str, where: str, mode: str
    ) -> None:
        self._store, self._key, self._where = store, key, where
        self.rank, self.size, self.job = rank, size, job
        self.mine = f"{mode} {socket.gethostname()} {os.getpid()} {uuid.uuid4().hex[:8]}"

    def take(self) -> bool:
        """Take the seat: True once taken; False while rank 0 has not posted its world yet (a
        rank other than 0, to call again). Raises where the world or the seat is another's."""
        if self.rank != 0:
            if not self._store.check([WORLD]):
                return False
            self._same_world(json.loads(bytes(self._store.get(WORLD))))
        got = bytes(self._store.compare_set(self._key, "", self.mine)).decode()
        if got != self.mine:
            raise LaunchEnvironmentError(self._taken(got))
        if self.rank == 0:
            self._store.set(WORLD, json.dumps({"size": self.size, "job": self.job}))
        return True

    def _same_world(self, world: dict[str, object]) -> None:
        theirs, size = str(world.get("job") or ""), world.get("size")
        if theirs and self.job and theirs != self.job:
            raise LaunchEnvironmentError(
                f"rank {self.rank}: the rendezvous at {self._where} is another job's (rank 0 "
                f"there is of {theirs}; this rank is of {self.job}).\n"
                "HINT: give each job its own rendezvous port (MASTER_PORT, torchrun "
                "--master-port, mpirun -x MASTER_PORT=...)."
            )
        if size != self.size:
            raise LaunchEnvironmentError(
                f"rank {self.rank}: this rank was started for a world of {self.size} ranks, "
                f"but rank 0 at {self._where} for a world of {size}.\n"
                "HINT: start every rank of a job with the same world size (WORLD_SIZE, -np, "
                "nodes x --nproc-per-node); two jobs on one address meet like this too: give "
                "each its own rendezvous port (MASTER_PORT)."
            )

    def _taken(self, holder: str) -> str:
        _mode, host, pid = [*holder.split(), "?", "?", "?"][:3]
        return (
            f"rank {self.rank}: another process already holds rank {self.rank} at "
            f"{self._where} (pid {pid} on {host}).\n"
            f"HINT: give each process of a job its own RANK, 0 to {self.size - 1}; two jobs on "
            "one address meet like this too: give each its own rendezvous port (MASTER_PORT)."
        )


def mode(post: bytes) -> str:
    """The arrival's word (secure or plain) of a seat's post."""
    words = post.decode().split()
    return words[0] if words else ""
