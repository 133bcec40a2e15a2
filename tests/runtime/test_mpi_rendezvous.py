"""The MPI rendezvous's pure parts; the exchange itself runs under real mpirun in
tests/cluster/test_launchers_mpirun.py."""

from __future__ import annotations

import sys

import pytest

from ringtrain.errors import LaunchEnvironmentError
from ringtrain.host.network import Interface
from ringtrain.runtime.environment import detect
from ringtrain.runtime.mpi_rendezvous import exchange, mpi_tcp_exclude

ETH0 = Interface("eth0", "198.18.0.10", 24, flags=("virtual",))
DOCKER0 = Interface("docker0", "172.17.0.1", 16, flags=("bridge", "docker", "virtual"))
BR0 = Interface("br0", "10.0.0.5", 24, flags=("bridge", "virtual"))


def test_runtime_bridges_are_kept_out_of_open_mpis_tcp_transport() -> None:
    assert mpi_tcp_exclude({}, [ETH0, DOCKER0]) == "127.0.0.1/8,sppp,docker0"


def test_a_plain_bridge_may_carry_the_job_and_stays_usable() -> None:
    assert mpi_tcp_exclude({}, [ETH0, BR0]) is None


def test_the_users_own_mpi_interface_choice_is_left_alone() -> None:
    for var in ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_btl_tcp_if_exclude"):
        assert mpi_tcp_exclude({var: "eth0"}, [ETH0, DOCKER0]) is None


def test_without_mpi4py_across_hosts_the_error_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails, as where it is not installed
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_exclude", "lo")  # so nothing is set in os.environ
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    p = detect(
        {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    with pytest.raises(LaunchEnvironmentError, match=r"pip install mpi4py.*MASTER_ADDR"):
        exchange(p, "h0", "", lambda addr, port: port)
