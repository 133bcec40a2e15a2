"""The rendezvous of a job started by a plain ``mpirun`` across hosts, found through MPI itself.

Open MPI tells each rank its rank and size but not where rank 0 is. When no ``MASTER_ADDR`` is
given and ranks span hosts, every rank gathers every host's interfaces over ``MPI_COMM_WORLD``
(mpi4py) and applies the launcher's network rules (:func:`ringtrain.host.network.choose`, or
``network_interface`` when set): a subnet every host shares and routes, never loopback, never a
``docker0`` that every host numbers alike. All ranks compute the same choice from the same
gathered data; rank 0 then serves the store on its chosen address (port 0 unless one is given,
so no port is guessed) and broadcasts the port. Each rank also gets its own chosen interface
for Gloo. MPI is used for these two exchanges only; the job's traffic stays on Gloo.

Open MPI's TCP transport would try a ``docker0`` that every host numbers 172.17.0.1 and wait
forever on itself, so unless the user chose MPI's interfaces, the runtime bridges found here
(named like docker0, virbr0, cni0) are excluded from it before MPI starts.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ringtrain import environ
from ringtrain.environ import OpenMPI
from ringtrain.errors import LaunchEnvironmentError, LaunchError
from ringtrain.host import network
from ringtrain.runtime.environment import Placement

log = logging.getLogger("ringtrain")


def exchange(
    p: Placement, host: str, interface_spec: str, serve: Callable[[str, int], int]
) -> tuple[Placement, str]:
    """The placement with rank 0's address and port, and this rank's interface name.

    ``serve(addr, port)`` is called on rank 0 only: it starts the store and returns its port.
    """
    local = network.local_interfaces()
    comm = _world(local)
    if comm.Get_rank() != p.rank or comm.Get_size() != p.size:
        raise LaunchEnvironmentError(
            f"mpi4py says rank {comm.Get_rank()} of {comm.Get_size()}, but Open MPI's variables "
            f"say rank {p.rank} of {p.size}.\nHINT: mpi4py must use the MPI library that "
            "mpirun belongs to (check `python -c 'from mpi4py import MPI; "
            "print(MPI.Get_library_version())'`)."
        )
    mine = [i.to_dict() for i in local]
    gathered: list[tuple[str, list[dict[str, Any]]]] = comm.allgather((host, mine))
    per_host: dict[str, list[network.Interface]] = {}
    for h, ifaces in gathered:
        per_host.setdefault(h, [network.Interface.from_dict(d) for d in ifaces])
    try:
        if interface_spec:
            picks = network.resolve_spec(interface_spec, per_host)
        else:
            picks = network.choose(per_host)
    except LaunchError as e:
        raise LaunchEnvironmentError(f"started by mpirun across hosts: {e}") from None
    addr = picks[gathered[0][0]].address
    port_or_error: int | str = p.rendezvous_port
    if p.rank == 0:
        try:
            port_or_error = serve(addr, p.rendezvous_port)
        except LaunchEnvironmentError as e:  # the others must fail too, not wait for the store
            port_or_error = str(e)
    port_or_error = comm.bcast(port_or_error, root=0)
    if isinstance(port_or_error, str):
        raise LaunchEnvironmentError(f"rank 0 could not start the rendezvous: {port_or_error}")
    log.debug("mpirun rendezvous at %s:%d, interface %s", addr, port_or_error, picks[host].name)
    placed = dataclasses.replace(p, rendezvous_addr=addr, rendezvous_port=port_or_error)
    return placed, picks[host].name


def mpi_tcp_exclude(env: Mapping[str, str], local: Sequence[network.Interface]) -> str | None:
    """The value for ``OMPI_MCA_btl_tcp_if_exclude``, or None to leave MPI's choice alone."""
    if OpenMPI.TCP_IF_INCLUDE in env or OpenMPI.TCP_IF_EXCLUDE in env:
        return None
    bridges = sorted({i.name for i in local if "docker" in i.flags})
    # Open MPI's own default, plus the bridges.
    return ",".join(["127.0.0.1/8", "sppp", *bridges]) if bridges else None


def _world(local: Sequence[network.Interface]) -> Any:
    if "mpi4py.MPI" not in sys.modules:  # MPI reads its settings when it starts
        exclude = mpi_tcp_exclude(environ.current(), local)
        if exclude:
            environ.set_var(OpenMPI.TCP_IF_EXCLUDE, exclude)
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise LaunchEnvironmentError(
            "started by mpirun with ranks on several hosts, but no rendezvous address is set "
            f"and mpi4py cannot be imported ({e}).\n"
            "HINT: install mpi4py (`pip install mpi4py`) so the ranks find rank 0 through MPI, "
            "or export MASTER_ADDR=<rank 0's host address> and MASTER_PORT=<free port> to every "
            "rank (`mpirun -x MASTER_ADDR=... -x MASTER_PORT=...`)."
        ) from None
    return MPI.COMM_WORLD
