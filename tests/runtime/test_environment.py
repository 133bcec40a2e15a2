"""Each launch environment, recognised by its variables alone (no processes)."""

from __future__ import annotations

import pytest

from ringtrain.errors import LaunchEnvironmentError
from ringtrain.runtime.environment import detect, expand_nodelist


def test_no_launcher_is_a_single_process() -> None:
    p = detect({})
    assert (p.launcher, p.rank, p.size) == ("single", 0, 1)


def test_ringtrain_launcher() -> None:
    p = detect(
        {
            "RINGTRAIN_RANK": "3",
            "RINGTRAIN_SIZE": "8",
            "RINGTRAIN_LOCAL_RANK": "1",
            "RINGTRAIN_LOCAL_SIZE": "4",
            "RINGTRAIN_RENDEZVOUS_ADDR": "198.18.0.1",
            "RINGTRAIN_RENDEZVOUS_PORT": "4000",
        }
    )
    assert (p.launcher, p.rank, p.size, p.local_rank, p.local_size) == ("ringtrain", 3, 8, 1, 4)
    assert (p.rendezvous_addr, p.rendezvous_port, p.store_hosted) == ("198.18.0.1", 4000, False)


def test_torchrun_with_agent_store() -> None:
    p = detect(
        {
            "RANK": "5",
            "WORLD_SIZE": "6",
            "LOCAL_RANK": "2",
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node0",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "x",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    assert (p.launcher, p.rank, p.size, p.local_rank, p.store_hosted) == ("torchrun", 5, 6, 2, True)
    assert (p.rendezvous_addr, p.rendezvous_port) == ("node0", 29400)


def test_open_mpi() -> None:
    p = detect(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_ADDR": "h0",
        }
    )
    assert (p.launcher, p.rank, p.size, p.local_size, p.rendezvous_port) == (
        "openmpi",
        1,
        4,
        2,
        29500,
    )


def test_mpirun_on_one_host_derives_a_loopback_rendezvous_from_the_job_id() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_ess_base_jobid": "496631809",
    }
    p = detect(env)
    assert (p.rendezvous_addr, p.rendezvous_via) == ("127.0.0.1", None)
    # Every rank of the job gets the same port, below Linux's ephemeral range (32768-).
    assert p.rendezvous_port == detect({**env, "OMPI_COMM_WORLD_RANK": "0"}).rendezvous_port
    assert 20000 <= p.rendezvous_port < 32768
    other = detect({**env, "OMPI_MCA_ess_base_jobid": "496631810"})
    assert other.rendezvous_port != p.rendezvous_port
    assert detect({**env, "MASTER_PORT": "4100"}).rendezvous_port == 4100


def test_mpirun_across_hosts_leaves_the_rendezvous_to_mpi() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    p = detect(env)
    assert (p.rank, p.size, p.rendezvous_via, p.rendezvous_port) == (2, 4, "mpi", 0)
    assert detect({**env, "MASTER_PORT": "4100"}).rendezvous_port == 4100
    # An explicit address wins: no MPI exchange.
    given = detect({**env, "MASTER_ADDR": "10.0.0.5"})
    assert (given.rendezvous_addr, given.rendezvous_via) == ("10.0.0.5", None)


def test_mpich_pmi() -> None:
    p = detect(
        {
            "PMI_RANK": "2",
            "PMI_SIZE": "3",
            "MPI_LOCALRANKID": "0",
            "MPI_LOCALNRANKS": "1",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "1234",
        }
    )
    assert (p.launcher, p.rank, p.size, p.local_rank) == ("mpich", 2, 3, 0)


def test_slurm_derives_master_and_port() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_NODELIST": "gpu[07-09,12],cpu1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1,1",
        "SLURM_JOB_ID": "123456",
    }
    p = detect(env)
    assert (p.launcher, p.rank, p.size, p.local_rank, p.local_size) == ("slurm", 5, 8, 1, 2)
    assert p.rendezvous_addr == "gpu07"
    assert p.rendezvous_port == 20000 + 123456 * 61 % 12768
    # Steps of one allocation that run at once meet in stores of their own.
    ports = {detect({**env, "SLURM_STEP_ID": str(s)}).rendezvous_port for s in range(8)}
    assert len(ports) == 8 and all(20000 <= p < 32768 for p in ports)


def test_expand_nodelist() -> None:
    assert expand_nodelist("a[1-3],b,c[08-10,15]") == [
        "a1",
        "a2",
        "a3",
        "b",
        "c08",
        "c09",
        "c10",
        "c15",
    ]


def test_kubeflow_pod_index_is_not_the_process_rank() -> None:
    env = {
        "RANK": "2",
        "WORLD_SIZE": "3",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "PET_NNODES": "3",
        "PET_NPROC_PER_NODE": "4",
        "LOCAL_RANK": "1",
    }
    p = detect(env)
    assert (p.launcher, p.rank, p.size, p.local_rank, p.local_size) == ("kubeflow", 9, 12, 1, 4)


def test_kubeflow_single_process_pods() -> None:
    p = detect(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "PET_MASTER_ADDR": "m",
            "PET_MASTER_PORT": "1",
            "PET_NNODES": "2",
        }
    )
    assert (p.rank, p.size, p.rendezvous_addr) == (1, 2, "m")


def test_inconsistent_rank_is_rejected() -> None:
    with pytest.raises(LaunchEnvironmentError, match="rank 4 is outside the world of size 4"):
        detect({"RINGTRAIN_RANK": "4", "RINGTRAIN_SIZE": "4", "RINGTRAIN_RENDEZVOUS_ADDR": "x"})


def test_garbage_rank_is_rejected() -> None:
    with pytest.raises(LaunchEnvironmentError, match="not an integer"):
        detect({"RINGTRAIN_RANK": "one", "RINGTRAIN_SIZE": "4", "RINGTRAIN_RENDEZVOUS_ADDR": "x"})
