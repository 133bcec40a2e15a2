"""Transport: the one interface the engine moves a bucket's bytes through.

Every process group the engine uses (Gloo, NCCL, the sealed group ``ringtrain_sealed``, the
tcp group ``ringtrain_tcp``) is wrapped in a :class:`Transport` by :func:`of`, and the code
above it never asks which; so is the hierarchical (2D) allreduce over a group's ranks
(``of(group, hierarchical)``: :class:`~ringtrain.transport.base.HierarchicalTransport`, whose
``reduce_scatter`` reduces every chunk, so it does not ``cut``). A transport offers the four
in-place operations the engine's exchanges are written with, each returning an :class:`InFlight`:

* ``allreduce(t)``: ``t`` becomes the sum over the group: the group's own allreduce (Gloo's,
  NCCL's, the sealed and tcp groups' ring as one operation), issued from the calling thread;
* ``reduce_scatter(chunks)``: rank r's ``chunks[r]`` becomes the sum of every rank's
  ``chunks[r]`` (the others hold partial sums afterwards);
* ``allgather(chunks)``: every rank's ``chunks[i]`` becomes rank i's ``chunks[i]``.
* ``broadcast(t, root)``: ``t`` becomes rank ``root``'s ``t``: the group's own broadcast, issued
  from the calling thread (local updates' anchor agreement sends rank 0's copy with it).

Chunk sizes may differ (alike on every rank). Sums follow a fixed order (the ring's, fixed by
rank; an allreduce's the group's), never timing, so every rank ends with the same bits.

Why a ring needs more than a process group: its every step is a *paired* send and receive that
must be in flight at once. Gloo's point-to-point calls are asynchronous, so a Gloo group gets
the ring (:class:`~ringtrain.transport.ring.Ring`) over it, run on a worker thread per group.
The sealed and tcp groups run one operation at a time on their own worker thread, which would run
a posted receive before its paired send: there the whole ring runs as *one* operation of the
group, on the group's own link (sealed, or plain over the tcp mesh), whose transport posts both
at once. NCCL has the collectives itself (``reduce_scatter_tensor``, ``all_gather_into_tensor``).

:mod:`ringtrain.transport.group_ops` holds the other collectives on a group: the engine's
(small agreements, the sharded step's and sparse gradients' all-gathers, a bucket's allreduce,
making groups), Horovod's API's (reductions by every op, broadcast, all-to-all, reduce-scatter,
the fast lane's prepared sum) and :func:`rounds`, what a codec with rounds of its own
(PowerSGD, top-k) runs them on (:class:`ringtrain.compression.codec.Rounds`): with :func:`of`,
the only door to ``torch.distributed`` for the engine, the collectives and the codecs.

The wire below the interface lives here too: :mod:`~ringtrain.transport.ring` (the ring over
point-to-point messages, given a session kind: plain, or sealed), the process groups built on
it (:mod:`~ringtrain.transport.ring_group`, :mod:`~ringtrain.transport.sealed_backend`,
:mod:`~ringtrain.transport.tcp_backend` over :mod:`~ringtrain.transport.tcp_mesh`), the
hierarchical allreduce (:mod:`~ringtrain.transport.hierarchical`), and which backend a job's
groups use (:mod:`~ringtrain.transport.backend_choice`, handed to the runtime by ``lifecycle``).

Everything that issues several collectives on one group from a thread other than the main one
(a codec's rounds, a local update's overlapped outer exchange) queues them whole on the group's
one worker (:class:`Hold` on :mod:`~ringtrain.transport.workers`), from the main thread: so they
meet each other in the same order on every rank.
"""

from __future__ import annotations

from ringtrain.transport.base import InFlight, Transport, of
from ringtrain.transport.group_ops import GroupRounds, rounds
from ringtrain.transport.workers import Hold, SharedWorkers, WorkerThread

__all__ = [
    "GroupRounds",
    "Hold",
    "InFlight",
    "SharedWorkers",
    "Transport",
    "WorkerThread",
    "of",
    "rounds",
]
