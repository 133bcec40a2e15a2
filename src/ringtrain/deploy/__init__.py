"""Deployment manifests: ``ringtrain k8s`` turns one job description into Kubernetes objects.

    spec.py       JobSpec: the description (image, command, pods, slots, CPUs, memory, secure, ...)
    manifests.py  PyTorchJob, MPIJob, TrainJob (+ TrainingRuntime) and the key's Secret: dicts
    sizing.py     the enclave's size and thread slots for --sgx
    gramine.py    the Gramine manifest template for --sgx
    render.py     YAML text (PyYAML, imported only there)
    command.py    the ``ringtrain k8s`` subcommand
    pod_init.py   ``ringtrain pod-init``: a durable MPIJob worker's PID 1, passing SIGTERM on

Pure functions of the description; nothing here imports torch (an import-linter contract).
"""

from ringtrain.deploy.manifests import generate
from ringtrain.deploy.spec import TARGETS, JobSpec

__all__ = ["TARGETS", "JobSpec", "generate"]
