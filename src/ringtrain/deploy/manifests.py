"""Kubernetes manifests from a :class:`JobSpec`: pure functions returning plain dictionaries.

Targets (``generate(spec, target, key)``):

* ``pytorchjob``: Kubeflow ``PyTorchJob`` (``kubeflow.org/v1``, training-operator v1): a Master
  pod and ``replicas - 1`` Worker pods. The operator gives every container ``MASTER_ADDR`` (the
  master pod's name), ``MASTER_PORT`` (the ``pytorchjob-port`` below), ``WORLD_SIZE``, ``RANK``
  (the pod's index) and ``PET_*``. One rank per pod runs the command as is (ringtrain reads
  those variables); several run under ``torchrun``, which reads ``PET_*``.
* ``mpijob``: ``MPIJob`` (``kubeflow.org/v2beta1``, mpi-operator): Worker pods run sshd, the
  Launcher pod runs ``mpirun`` with the operator's hostfile (``/etc/mpi/hostfile``, one line per
  worker with ``slots=``). Ranks started by mpirun see only what ``-x`` forwards, so the
  command forwards ringtrain's settings and rank 0's address (worker 0, where mpirun's default
  mapping puts it).
* ``trainjob``: Trainer v2 ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``) and the namespaced
  ``TrainingRuntime`` it references, which carries the pod template (resources, key volume).
  The torch plugin injects only ``PET_*``, so ranks always start under ``torchrun``.

Every target also gets a ``Secret`` with the job key when the job is secure. Pods are
Guaranteed QoS with whole CPUs (requests == limits), so a kubelet with the static CPU manager
policy gives them exclusive cores; ``OMP_NUM_THREADS`` shares those out among the pod's ranks.
Pods that run ranks mount a memory-backed ``emptyDir`` of ``spec.shm_size`` at ``/dev/shm``
(the runtime's own is 64 MiB).
Pods set no ``fsGroup``: with one, Kubernetes makes the mounted key group-readable (0440,
kubernetes#57923), which ringtrain refuses. ``sgx`` adds the SGX device plugin's resources and
runs each rank through ``gramine-sgx``. Where the ranks save (``checkpoint_dir`` in settings),
pods get the time to save on a preemption (``terminationGracePeriodSeconds``; mpirun's
``odls_base_sigkill_timeout``).
"""

from __future__ import annotations

import base64
import copy
from typing import Any

from ringtrain.deploy import gramine, sizing
from ringtrain.deploy.spec import TARGETS, JobSpec
from ringtrain.environ import Process, Threads, Torch
from ringtrain.errors import ConfigError

Manifest = dict[str, Any]

KEY_DIR = "/var/run/secrets/ringtrain"
KEY_ITEM = "job.key"
KEY_FILE = f"{KEY_DIR}/{KEY_ITEM}"
KEY_VOLUME = "ringtrain-key"
SHM_DIR = "/dev/shm"
SHM_VOLUME = "ringtrain-shm"
# The training operator looks up the master's port by these names.
PYTORCH_CONTAINER = "pytorch"
PYTORCH_PORT_NAME = "pytorchjob-port"
# Trainer v2's torch plugin fills the container named "node" of the replicated job marked as
# the trainer step.
TRAINER_CONTAINER = "node"
TRAINER_ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
MPI_HOSTFILE = "/etc/mpi/hostfile"
SSH_DIR = "/root/.ssh"
# Intel's SGX device plugin: EPC memory, the enclave device, and the provisioning device
# (attestation).
SGX_EPC = "sgx.intel.com/epc"
SGX_ENCLAVE = "sgx.intel.com/enclave"
SGX_PROVISION = "sgx.intel.com/provision"
LAUNCHER_CPUS = 1
LAUNCHER_MEMORY = "512Mi"
# Where ranks save on a preemption, a pod's time after its grace period for the save's commit
# and the processes' ends.
EXIT_SLACK_S = 10
# A durable MPIJob worker's first process: it passes the pod's SIGTERM on to the ranks.
POD_INIT = ["ringtrain", "pod-init", "--"]


class Octal(int):
    """An int written in YAML as octal (file modes: ``0400``); its value is the int."""


def secret_name(spec: JobSpec) -> str:
    return f"{spec.name}-ringtrain-key"


def _labels(spec: JobSpec, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ringtrain",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
    }


def _metadata(spec: JobSpec, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": _labels(spec, component)}


def _resources(spec: JobSpec, cpus: int, memory: str) -> dict[str, Any]:
    # requests == limits with whole CPUs: Guaranteed QoS, exclusive cores under the static policy.
    amounts: dict[str, Any] = {"cpu": str(cpus), "memory": memory}
    if spec.sgx:
        plan = sizing.plan(spec)
        epc = plan.enclave_bytes * spec.slots
        amounts.update({SGX_EPC: f"{epc >> 20}Mi", SGX_ENCLAVE: "1", SGX_PROVISION: "1"})
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _env(spec: JobSpec) -> list[dict[str, str]]:
    env = {Threads.OMP_NUM_THREADS: str(spec.threads_per_rank), Process.PYTHONUNBUFFERED: "1"}
    env.update(spec.ringtrain_env(KEY_FILE))
    env.update(spec.env)
    return [{"name": k, "value": v} for k, v in env.items()]


def _rank_volumes(spec: JobSpec) -> list[dict[str, Any]]:
    """The volumes of a pod that runs ranks: its /dev/shm, and the key when the job is secure."""
    # Container runtimes give /dev/shm 64 MiB, less than a checkpoint part's copy in the process
    # writer needs (or DataLoader workers' batches): a memory-backed emptyDir of its own size.
    shm = {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}
    if not spec.sealed:
        return [shm]
    return [
        shm,
        {
            "name": KEY_VOLUME,
            "secret": {
                "secretName": secret_name(spec),
                "defaultMode": Octal(0o400),
                "items": [{"key": KEY_ITEM, "path": KEY_ITEM}],
            },
        },
    ]


def _rank_mounts(spec: JobSpec) -> list[dict[str, Any]]:
    shm = {"name": SHM_VOLUME, "mountPath": SHM_DIR}
    if not spec.sealed:
        return [shm]
    return [shm, {"name": KEY_VOLUME, "mountPath": KEY_DIR, "readOnly": True}]


def rank_command(spec: JobSpec) -> list[str]:
    """What starts one rank: the command, or ``gramine-sgx`` (the argv is in the manifest)."""
    return ["gramine-sgx", gramine.MANIFEST_NAME] if spec.sgx else list(spec.command)


def _torchrun(spec: JobSpec) -> list[str]:
    # torchrun takes nodes, node rank, processes per node and rank 0's address from PET_*;
    # --no-python runs the rank command as given (gramine-sgx included: enclaves per rank).
    return ["torchrun", "--no-python", *rank_command(spec)]


def _container(spec: JobSpec, name: str, command: list[str]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": spec.image,
        "command": command,
        "env": _env(spec),
        "resources": _resources(spec, spec.cpus, spec.memory),
        "volumeMounts": _rank_mounts(spec),
    }
    return container


def _pod_template(
    spec: JobSpec,
    component: str,
    containers: list[dict[str, Any]],
    volumes: list[Any],
    grace_s: int | None = None,
) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": containers}
    if volumes:
        pod["volumes"] = volumes
    if grace_s is not None:
        pod["terminationGracePeriodSeconds"] = grace_s
    return {"metadata": {"labels": _labels(spec, component)}, "spec": pod}


def _termination_grace_s(spec: JobSpec, times: int = 1) -> int | None:
    """A pod's time from the kubelet's SIGTERM to its SIGKILL where the ranks save on a
    preemption: ``times`` their grace period (mpirun's pod: 2, see :func:`mpirun_command`) and
    EXIT_SLACK_S. None elsewhere: the kubelet's default (30 s)."""
    grace_s = spec.stop_grace_s
    return None if grace_s is None else times * grace_s + EXIT_SLACK_S


def secret(spec: JobSpec, key: bytes) -> Manifest:
    """The Secret holding the job key as one hex line (what ringtrain's key files hold)."""
    from ringtrain.security.keys import encode_key

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(spec, secret_name(spec), "key"),
        "type": "Opaque",
        "data": {KEY_ITEM: base64.b64encode(encode_key(key)).decode("ascii")},
    }


def pytorchjob(spec: JobSpec) -> Manifest:
    command = rank_command(spec) if spec.slots == 1 else _torchrun(spec)
    container = _container(spec, PYTORCH_CONTAINER, command)
    container["ports"] = [
        {"name": PYTORCH_PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}
    ]
    volumes = _rank_volumes(spec)
    replicas: dict[str, Any] = {
        "Master": {
            "replicas": 1,
            "restartPolicy": "Never",
            "template": _pod_template(
                spec, "master", [container], volumes, _termination_grace_s(spec)
            ),
        }
    }
    if spec.replicas > 1:
        replicas["Worker"] = {
            "replicas": spec.replicas - 1,
            "restartPolicy": "Never",
            "template": _pod_template(
                spec,
                "worker",
                [copy.deepcopy(container)],
                copy.deepcopy(volumes),
                _termination_grace_s(spec),
            ),
        }
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": _metadata(spec, spec.name, "job"),
        "spec": {
            # A lost rank cannot rejoin a running ring: fail the job, do not restart pods.
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "All"},
            "nprocPerNode": str(spec.slots),
            "pytorchReplicaSpecs": replicas,
        },
    }


def mpi_worker_host(spec: JobSpec, index: int) -> str:
    """A worker's name in the hostfile mpi-operator writes (pod.service.namespace.svc)."""
    return f"{spec.name}-worker-{index}.{spec.name}-worker.{spec.namespace}.svc"


def mpirun_command(spec: JobSpec) -> list[str]:
    """The launcher's command: mpirun over the operator's hostfile, forwarding what ranks need."""
    forwarded = {
        Torch.MASTER_ADDR: mpi_worker_host(spec, 0),
        Torch.MASTER_PORT: str(spec.port),
        Threads.OMP_NUM_THREADS: str(spec.threads_per_rank),
        Process.PYTHONUNBUFFERED: "1",
        **spec.ringtrain_env(KEY_FILE),
        **spec.env,
    }
    argv = ["mpirun", "--allow-run-as-root", "-np", str(spec.world_size)]
    # Placement on cores is the CPU manager's (the pod's cpuset): mpirun binding inside a pod
    # would pin ranks of pods sharing a node to the same cores where the policy is not static.
    argv += ["--map-by", "slot", "--bind-to", "none", "-x", Process.PATH]
    if spec.stop_grace_s is not None:
        # mpirun passes a SIGTERM on this long after its own, and SIGKILLs as long after that
        # (1 s by default): the ranks' grace period to stop at a step and save it.
        argv += ["--mca", "odls_base_sigkill_timeout", str(spec.stop_grace_s)]
    for name, value in forwarded.items():
        argv += ["-x", f"{name}={value}"]
    return [*argv, *rank_command(spec)]


def mpijob(spec: JobSpec) -> Manifest:
    launcher = {
        "name": "launcher",
        "image": spec.image,
        "command": mpirun_command(spec),
        "resources": {
            "requests": {"cpu": str(LAUNCHER_CPUS), "memory": LAUNCHER_MEMORY},
            "limits": {"cpu": str(LAUNCHER_CPUS), "memory": LAUNCHER_MEMORY},
        },
    }
    sshd = ["/usr/sbin/sshd", "-De"]
    if spec.stop_grace_s is not None:
        # The kubelet's SIGTERM reaches PID 1 alone: sshd there would end on it, and with it
        # every process of the pod, the ranks unsaved (deploy/pod_init.py).
        sshd = [*POD_INIT, *sshd]
    worker = _container(spec, "worker", sshd)
    # The ranks' environment comes through mpirun's -x, not the worker container's env.
    del worker["env"]
    return {
        "apiVersion": "kubeflow.org/v2beta1",
        "kind": "MPIJob",
        "metadata": _metadata(spec, spec.name, "job"),
        "spec": {
            "slotsPerWorker": spec.slots,
            "mpiImplementation": "OpenMPI",
            "sshAuthMountPath": SSH_DIR,
            "launcherCreationPolicy": "WaitForWorkersReady",
            "runPolicy": {"backoffLimit": 0, "cleanPodPolicy": "Running"},
            "mpiReplicaSpecs": {
                "Launcher": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": _pod_template(
                        spec, "launcher", [launcher], [], _termination_grace_s(spec, times=2)
                    ),
                },
                "Worker": {
                    "replicas": spec.replicas,
                    "restartPolicy": "Never",
                    "template": _pod_template(
                        spec,
                        "worker",
                        [worker],
                        _rank_volumes(spec),
                        _termination_grace_s(spec, times=2),
                    ),
                },
            },
        },
    }


def runtime_name(spec: JobSpec) -> str:
    return f"{spec.name}-ringtrain"


def trainingruntime(spec: JobSpec) -> Manifest:
    container = _container(spec, TRAINER_CONTAINER, _torchrun(spec))
    pod = _pod_template(spec, "node", [container], _rank_volumes(spec), _termination_grace_s(spec))
    # As the other targets: a lost rank fails the job. Unset, Job's backoffLimit is 6 retries,
    # each a pod that cannot rejoin the running ring.
    pod["spec"]["restartPolicy"] = "Never"
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainingRuntime",
        "metadata": _metadata(spec, runtime_name(spec), "runtime"),
        "spec": {
            "mlPolicy": {"numNodes": spec.replicas, "torch": {}},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": "node",
                            "template": {
                                "metadata": {"labels": {TRAINER_ANCESTOR_LABEL: "trainer"}},
                                "spec": {"backoffLimit": 0, "template": pod},
                            },
                        }
                    ]
                }
            },
        },
    }


def trainjob(spec: JobSpec) -> Manifest:
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": _metadata(spec, spec.name, "job"),
        "spec": {
            "runtimeRef": {
                "name": runtime_name(spec),
                "apiGroup": "trainer.kubeflow.org",
                "kind": "TrainingRuntime",
            },
            "trainer": {
                "image": spec.image,
                "command": _torchrun(spec),
                "numNodes": spec.replicas,
                "numProcPerNode": spec.slots,
            },
        },
    }


def generate(spec: JobSpec, target: str, key: bytes | None = None) -> list[Manifest]:
    """Every manifest of ``spec`` on ``target``, the key's Secret first when the job is secure.

    ``key`` is the job key to put in the Secret; a secure job without one gets no Secret (create
    it yourself: docs/deploy.md).
    """
    if target not in TARGETS:
        raise ConfigError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    out: list[Manifest] = []
    if spec.sealed and key is not None:
        out.append(secret(spec, key))
    if target == "pytorchjob":
        out.append(pytorchjob(spec))
    elif target == "mpijob":
        out.append(mpijob(spec))
    else:
        out += [trainingruntime(spec), trainjob(spec)]
    return out
