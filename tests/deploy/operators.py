"""What the operators add to the generated pods, read from their source, for running the pods'
commands without a cluster.

* training-operator v1 (PyTorchJob), ``pkg/controller.v1/pytorch/envvar.go`` and ``master.go``:
  every container gets ``MASTER_ADDR`` = ``<job>-master-0`` (the master's headless Service),
  ``MASTER_PORT`` = the container port named ``pytorchjob-port``, the same as ``PET_MASTER_ADDR``
  / ``PET_MASTER_PORT``, ``WORLD_SIZE`` = pods x ``nprocPerNode``, ``RANK`` = the pod's index
  (master 0, worker i -> i + 1), ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` = ``RANK``,
  ``PET_NNODES`` = pods (no elastic policy), and ``PYTHONUNBUFFERED=0``.
* Trainer v2 torch plugin (kubeflow/trainer ``pkg/runtime/framework/plugins/torch/torch.go``):
  ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (the Job completion index),
  ``PET_MASTER_ADDR`` = ``<trainjob>-node-0-0.<trainjob>`` and ``PET_MASTER_PORT`` = 29500
  (``constants.ContainerTrainerPort``).
* mpi-operator v2beta1 (``pkg/controller/mpi_job_controller.go``): the launcher gets
  ``OMPI_MCA_orte_keep_fqdn_hostnames=true``, ``OMPI_MCA_orte_default_hostfile=/etc/mpi/hostfile``,
  ``OMPI_MCA_plm_rsh_args=-o ConnectionAttempts=10``, ``OMPI_MCA_orte_set_default_slots`` and
  ``K_MPI_JOB_ROLE=launcher``; the hostfile has one line per worker,
  ``<job>-worker-<i>.<job>-worker.<namespace>.svc slots=<slotsPerWorker>``; workers without a
  command run ``/usr/sbin/sshd -De`` with the operator's ssh key mounted at sshAuthMountPath.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRAINER_PORT = 29500


@dataclass(frozen=True)
class Pod:
    """One pod as its operator makes it: a name, the container's argv and environment."""

    name: str
    argv: list[str]
    env: dict[str, str]


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _argv(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def pytorchjob_pods(job: dict[str, Any]) -> list[Pod]:
    name = job["metadata"]["name"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    nproc = job["spec"].get("nprocPerNode", "1")
    nproc_int = int(nproc) if str(nproc).isdigit() else 1
    total = sum(int(r["replicas"]) for r in specs.values())
    master = specs["Master"]["template"]["spec"]["containers"][0]
    port = next(p["containerPort"] for p in master["ports"] if p["name"] == "pytorchjob-port")
    pods = []
    for rtype, offset in (("Master", 0), ("Worker", 1)):
        if rtype not in specs:
            continue
        container = specs[rtype]["template"]["spec"]["containers"][0]
        for index in range(int(specs[rtype]["replicas"])):
            rank = index + offset
            env = _container_env(container)
            env.update(
                {
                    "PYTHONUNBUFFERED": "0",
                    "MASTER_PORT": str(port),
                    "PET_MASTER_PORT": str(port),
                    "MASTER_ADDR": f"{name}-master-0",
                    "PET_MASTER_ADDR": f"{name}-master-0",
                    "WORLD_SIZE": str(total * nproc_int),
                    "RANK": str(rank),
                    "PET_NPROC_PER_NODE": str(nproc),
                    "PET_NODE_RANK": str(rank),
                    "PET_NNODES": str(total),
                }
            )
            pods.append(Pod(f"{name}-{rtype.lower()}-{index}", _argv(container), env))
    return pods


def trainjob_pods(runtime: dict[str, Any], trainjob: dict[str, Any]) -> list[Pod]:
    name = trainjob["metadata"]["name"]
    trainer = trainjob["spec"]["trainer"]
    rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    container = next(
        c for c in rjob["template"]["spec"]["template"]["spec"]["containers"] if c["name"] == "node"
    )
    nodes = int(trainer.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"]))
    pods = []
    for index in range(nodes):
        env = _container_env(container)
        env.update({e["name"]: e["value"] for e in trainer.get("env", [])})
        env.update(
            {
                "PET_NNODES": str(nodes),
                "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                "PET_NODE_RANK": str(index),
                "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
                "PET_MASTER_PORT": str(TRAINER_PORT),
            }
        )
        argv = [*trainer.get("command", container.get("command", [])), *trainer.get("args", [])]
        pods.append(Pod(f"{name}-node-0-{index}", argv, env))
    return pods


def mpijob_hostfile(job: dict[str, Any]) -> str:
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    slots = job["spec"].get("slotsPerWorker", 1)
    workers = int(job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"])
    return "".join(
        f"{name}-worker-{i}.{name}-worker.{ns}.svc slots={slots}\n" for i in range(workers)
    )


def mpijob_launcher(job: dict[str, Any], hostfile_path: str) -> Pod:
    name = job["metadata"]["name"]
    container = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    env = _container_env(container)
    env.update(
        {
            "K_MPI_JOB_ROLE": "launcher",
            "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
            "OMPI_MCA_orte_default_hostfile": hostfile_path,
            "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
            "OMPI_MCA_orte_set_default_slots": str(job["spec"].get("slotsPerWorker", 1)),
        }
    )
    return Pod(f"{name}-launcher", _argv(container), env)


def mpijob_workers(job: dict[str, Any]) -> list[str]:
    """The workers' host names, as the hostfile lists them."""
    return [line.split()[0] for line in mpijob_hostfile(job).splitlines()]
