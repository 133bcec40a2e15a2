"""The generated jobs, executed: one namespace host per pod, each given what its operator injects
(:mod:`tests.deploy.operators`), running the container command from the manifest, training a
tiny model to the same weights as one process computing the same steps.

What stands in for Kubernetes: the pods' DNS names are lines in each host's ``/etc/hosts``; the
key Secret's volume is the Secret's data in a file (mode 0400, root's) bind-mounted at the
mount path inside the pod's mount namespace, and the memory-backed emptyDir at ``/dev/shm`` a
tmpfs of its ``sizeLimit`` mounted there; MPIJob's ssh key mount at ``/root/.ssh`` is the
test cluster's ssh config (given to mpirun through ``OMPI_MCA_plm_rsh_args``), and the
operator's hostfile is a file named by ``OMPI_MCA_orte_default_hostfile`` as the operator sets.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from ringtrain.deploy import gramine, manifests, sizing
from ringtrain.deploy.spec import JobSpec, memory_bytes
from ringtrain.testing import cluster as tc
from ringtrain.testing.netns import ETC_NETNS

from . import operators, train_tiny

# A job's own limit, and the test's above it (cluster set-up and checks included). Under
# pytest-xdist these tests run one after another in their own group, beside the other cluster
# tests' worker, not on it: each makes its own cluster, and only they share the key's mount
# point (manifests.KEY_DIR) on this machine.
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300), pytest.mark.xdist_group("deploy")]
PY = sys.executable
SCRIPT = Path(__file__).with_name("train_tiny.py")
STEPS = 4
JOB_TIMEOUT_S = 200.0
KEY = bytes(range(100, 132))


def describe(out: Path, **more: Any) -> JobSpec:
    return JobSpec.from_mapping(
        {
            "name": "tiny",
            "image": "local",
            "command": [PY, str(SCRIPT), "--steps", str(STEPS), "--out", str(out)],
            "replicas": 2,
            "cpus": 1,
            "memory": "1Gi",
            "settings": {"timeout_s": 60.0},
            **more,
        }
    )


def _base_env() -> dict[str, str]:
    """What the image provides: a PATH with its Python (and torchrun) first. And where torchrun
    keeps its logs (tests/conftest.py's folder, removed when the tests end): a pod's /tmp goes
    with the pod, these pods' is the machine's."""
    path = f"{Path(PY).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    logs = {k: v for k, v in os.environ.items() if k == "PET_LOG_DIR"}
    return {"PATH": path, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", **logs}


def _name_hosts(cluster: tc.Cluster, names: dict[str, str]) -> None:
    """Make pod names resolve on every host (``names``: pod DNS name -> cluster host)."""
    lines = "".join(f"{cluster.host(h).address} {n}\n" for n, h in names.items())
    for h in cluster.hosts:
        with open(ETC_NETNS / h.netns / "hosts", "a") as f:
            f.write(lines)


@contextlib.contextmanager
def _secret_volume(secret: dict[str, Any] | None, tmp_path: Path) -> Iterator[Path | None]:
    """The Secret as the kubelet writes its volume: one file per item, mode 0400, root's; and
    the empty mount point (created here if missing, removed after)."""
    if secret is None:
        yield None
        return
    volume = tmp_path / "secret-volume"
    volume.mkdir(mode=0o755)
    for item, data in secret["data"].items():
        path = volume / item
        path.write_bytes(base64.b64decode(data))
        path.chmod(0o400)
    made = []
    target = Path(manifests.KEY_DIR)
    for p in [*reversed(target.parents), target]:
        if not p.exists():
            p.mkdir()
            made.append(p)
    try:
        yield volume
    finally:
        for p in reversed(made):
            with contextlib.suppress(OSError):
                p.rmdir()


def _dev_shm_bytes(doc: Any) -> int:
    """The size of the memory-backed emptyDir that ``doc``'s rank pods mount at /dev/shm (one
    size for every pod of the job)."""
    found: set[int] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            mounts = {m["name"]: m["mountPath"] for m in node.get("volumeMounts", [])}
            for c in node.get("containers", []):
                mounts.update({m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])})
            for v in node.get("volumes", []):
                if v.get("emptyDir", {}).get("medium") == "Memory" and (
                    mounts.get(v["name"]) == "/dev/shm"
                ):
                    found.add(memory_bytes(v["emptyDir"]["sizeLimit"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    (size,) = found
    return size


def _shm_mount(size: int) -> list[str]:
    """What the kubelet mounts for a memory-backed emptyDir of ``size`` bytes at /dev/shm."""
    return ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "shm", "/dev/shm"]


def _mounted(argv: Sequence[str], volume: Path | None, shm: int) -> list[str]:
    """``argv`` in a pod whose mount namespace has its /dev/shm (``shm`` bytes) and the key
    volume at its mount path (the command runs in the host's own mount namespace: ``ip netns
    exec`` makes one)."""
    script = " ".join(_shm_mount(shm)) + " && "
    if volume is not None:
        script += f'mount --bind "$1" {manifests.KEY_DIR} && '
    return ["sh", "-c", script + 'shift && exec "$@"', "pod", str(volume), *argv]


def _run(
    cluster: tc.Cluster,
    started: list[tuple[str, list[str], dict[str, str]]],
    logs: Path,
    timeout_s: float = JOB_TIMEOUT_S,
) -> None:
    """Start every (host, argv, env), wait for all; on a failure or the timeout, end them all
    and fail with each one's output."""
    logs.mkdir(exist_ok=True)
    procs = []
    for i, (host, argv, env) in enumerate(started):
        out = open(logs / f"{i}-{host}.log", "wb")  # noqa: SIM115 - closed below
        procs.append(
            (
                host,
                out,
                cluster.popen(
                    host,
                    argv,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                ),
            )
        )
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for _h, _o, p in procs):
            failed = [p for _h, _o, p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for _h, out, p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
            out.close()
    report = "\n".join(
        f"--- {h} (exit {p.returncode}):\n{(logs / f'{i}-{h}.log').read_text()[-3000:]}"
        for i, (h, _o, p) in enumerate(procs)
    )
    assert all(p.returncode == 0 for _h, _o, p in procs), report


def _reference_weights(world: int) -> torch.Tensor:
    """The same steps in one process: the mean of every rank's loss, one SGD step each."""
    net = train_tiny.model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(
            torch.nn.functional.mse_loss(net(x), y)
            for x, y in (train_tiny.batch(r, step) for r in range(world))
        )
        (loss / world).backward()  # type: ignore[operator]
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _check_reports(out: Path, spec: JobSpec, launcher: str, hosts: set[str]) -> None:
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(spec.world_size)]
    want = _reference_weights(spec.world_size)
    plan = sizing.plan(spec)
    for rep in reports:
        assert rep["size"] == spec.world_size
        assert rep["launcher"] == launcher
        assert rep["secure"] is spec.sealed
        torch.testing.assert_close(torch.tensor(rep["weights"]), want, rtol=1e-5, atol=1e-6)
        assert rep["omp_threads"] == spec.threads_per_rank
        # What --sgx would give this rank: the estimate must cover what it used.
        assert rep["threads"] <= plan.max_threads - sizing.GRAMINE_THREADS, rep["threads"]
        assert rep["vm_hwm_bytes"] + rep["mapped_objects_bytes"] <= sizing.RUNTIME_BASE_BYTES
        # The pod's /dev/shm as its manifest sized it, not the runtime's 64 MiB (an enclave
        # sees its own, empty one).
        if not spec.sgx:
            assert rep["dev_shm_bytes"] == memory_bytes(spec.shm_size) > 64 << 20
    assert len({tuple(r["weights"]) for r in reports}) == 1, "ranks disagree"
    assert {r["hostname"] for r in reports} == hosts


@pytest.mark.parametrize(
    ("secure", "slots"), [(False, 1), (True, 2)], ids=["plain-1slot", "secure-2slots"]
)
def test_pytorchjob_trains_on_namespace_hosts(
    make_cluster: Any, tmp_path: Path, secure: bool, slots: int
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    spec = describe(out, secure=secure, slots=slots, cpus=slots)
    docs = manifests.generate(spec, "pytorchjob", KEY if secure else None)
    secret = next((d for d in docs if d["kind"] == "Secret"), None)
    (job,) = [d for d in docs if d["kind"] == "PyTorchJob"]
    pods = operators.pytorchjob_pods(job)
    shm = _dev_shm_bytes(job)
    cluster = make_cluster(len(pods))
    hosts = {pod.name: h.name for pod, h in zip(pods, cluster.hosts)}
    _name_hosts(cluster, hosts)
    with _secret_volume(secret, tmp_path) as volume:
        _run(
            cluster,
            [
                (hosts[pod.name], _mounted(pod.argv, volume, shm), {**_base_env(), **pod.env})
                for pod in pods
            ],
            tmp_path / "logs",
        )
    _check_reports(out, spec, "kubeflow" if slots == 1 else "torchrun", set(hosts.values()))


# What stands in for `gramine-sgx ringtrain`: the manifest's measured argv, only the variables
# the manifest lets through (and its own PATH), every system call Gramine lacks failing as it
# does there (the enclave sandbox, not strict: Gramine returns errors, it does not kill; a
# library that copes with the error, as glibc's resolver may, must keep working).
GRAMINE_STAND_IN = """#!{py}
import json, os
manifest = json.load(open({manifest!r}))
env = {{k: os.environ[k] for k in manifest["passthrough"] if k in os.environ}}
env.update(manifest["env"])
argv = manifest["argv"]
os.execve(argv[0], [argv[0], "-m", "ringtrain.testing.enclave", "--", *argv[1:]], env)
"""


def _gramine_stand_in(spec: JobSpec, tmp_path: Path) -> Path:
    """A ``gramine-sgx`` on a directory to put first in PATH, running the rendered template."""
    tomllib = pytest.importorskip("tomllib")
    jinja2 = pytest.importorskip("jinja2")
    text = gramine.template(spec, manifests.KEY_DIR)
    # Only loader.* matters here; the mounts' and trusted files' helpers render to nothing.
    loader = "\n".join(line for line in text.splitlines() if line.startswith("loader."))
    rendered = (
        jinja2.Environment(undefined=jinja2.StrictUndefined)
        .from_string(loader)
        .render(entrypoint=PY, arch_libdir="/lib/x86_64-linux-gnu", log_level="error")
    )
    env = tomllib.loads(rendered)["loader"]
    manifest = {
        "argv": env["argv"],
        "passthrough": [k for k, v in env["env"].items() if v == {"passthrough": True}],
        "env": {k: v for k, v in env["env"].items() if isinstance(v, str)},
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "gramine-sgx"
    script.write_text(GRAMINE_STAND_IN.format(py=PY, manifest=str(tmp_path / "manifest.json")))
    script.chmod(0o755)
    return bin_dir


# Sandboxed ranks on a busy 2-core machine: more time than the other jobs get.
@pytest.mark.timeout(480)
@pytest.mark.parametrize("slots", [1, 2], ids=["1slot-store-in-rank0", "2slots-torchrun"])
def test_sgx_pytorchjob_trains_with_every_rank_in_an_enclave_stand_in(
    make_cluster: Any, tmp_path: Path, slots: int
) -> None:
    """The --sgx PyTorchJob: each pod runs `gramine-sgx ringtrain` (through torchrun for 2
    slots; with 1 slot, rank 0 serves the rendezvous store from inside its enclave), here the
    enclave sandbox with the template's argv and passed variables. Ranks reach each other over
    ringtrain's own sockets (the manifest's transport=tcp; Gloo could not start) and train to
    the reference weights, each within the enclave's thread estimate."""
    out = tmp_path / "out"
    out.mkdir()
    spec = describe(out, sgx=True, slots=slots, cpus=slots, settings={"timeout_s": 120.0})
    secret, job = manifests.generate(spec, "pytorchjob", KEY)
    pods = operators.pytorchjob_pods(job)
    assert pods[0].argv[-2:] == ["gramine-sgx", "ringtrain"]
    shm = _dev_shm_bytes(job)
    bin_dir = _gramine_stand_in(spec, tmp_path)
    cluster = make_cluster(len(pods))
    hosts = {pod.name: h.name for pod, h in zip(pods, cluster.hosts)}
    _name_hosts(cluster, hosts)
    base = _base_env()
    base["PATH"] = f"{bin_dir}:{base['PATH']}"
    with _secret_volume(secret, tmp_path) as volume:
        _run(
            cluster,
            [
                (hosts[pod.name], _mounted(pod.argv, volume, shm), {**base, **pod.env})
                for pod in pods
            ],
            tmp_path / "logs",
            timeout_s=2 * JOB_TIMEOUT_S,
        )
    _check_reports(out, spec, "kubeflow" if slots == 1 else "torchrun", set(hosts.values()))
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(spec.world_size)]
    assert {(r["backend"], r["transport"], r["netlink"]) for r in reports} == {
        ("ringtrain_sealed", "tcp", False)
    }


def test_trainjob_trains_on_namespace_hosts(make_cluster: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    spec = describe(out, secure=True)
    secret, runtime, trainjob = manifests.generate(spec, "trainjob", KEY)
    pods = operators.trainjob_pods(runtime, trainjob)
    shm = _dev_shm_bytes(runtime)
    cluster = make_cluster(len(pods))
    hosts = {pod.name: h.name for pod, h in zip(pods, cluster.hosts)}
    # The JobSet's headless Service: <trainjob>-node-0-<i>.<trainjob>.
    _name_hosts(cluster, {f"{n}.{spec.name}": h for n, h in hosts.items()})
    with _secret_volume(secret, tmp_path) as volume:
        _run(
            cluster,
            [
                (hosts[pod.name], _mounted(pod.argv, volume, shm), {**_base_env(), **pod.env})
                for pod in pods
            ],
            tmp_path / "logs",
        )
    _check_reports(out, spec, "torchrun", set(hosts.values()))


def _ssh_config(cluster: tc.Cluster, names: dict[str, str], tmp_path: Path) -> Path:
    """The launcher's ssh setup (mpi-operator mounts a key pair at /root/.ssh): the cluster's
    client key, and its host keys pinned under the workers' DNS names."""
    by_address = {cluster.host(h).address: n for n, h in names.items()}
    known = []
    for line in cluster.known_hosts_path.read_text().splitlines():
        hostport, key = line.split(" ", 1)
        address = hostport.strip("[").split("]")[0]
        if address in by_address:
            known.append(f"[{by_address[address]}]:{cluster.port} {key}")
    (tmp_path / "known_hosts").write_text("\n".join(known) + "\n")
    config = tmp_path / "ssh_config"
    config.write_text(
        "\n".join(
            [
                "Host *",
                f"    Port {cluster.port}",
                "    User root",
                f"    IdentityFile {cluster.identity_file}",
                "    IdentitiesOnly yes",
                f"    UserKnownHostsFile {tmp_path / 'known_hosts'}",
                "    GlobalKnownHostsFile /dev/null",
                "    StrictHostKeyChecking yes",
                "    BatchMode yes",
                "    LogLevel ERROR",
                "",
            ]
        )
    )
    return config


def mpijob_on_hosts(
    make_cluster: Any, job: dict[str, Any], tmp_path: Path, stdin: bool = True
) -> tuple[tc.Cluster, operators.Pod, dict[str, str]]:
    """A cluster for an MPIJob (its launcher pod's host first, then one per worker, named as
    the operator names them), and the launcher's command and environment there: the operator's
    hostfile, and ssh as its mounted key pair gives it (``stdin`` False: ``ssh -n``)."""
    workers = operators.mpijob_workers(job)
    cluster = make_cluster(1 + len(workers))
    names = {w: h.name for w, h in zip(workers, cluster.hosts[1:])}
    names[f"{job['metadata']['name']}-launcher"] = cluster.hosts[0].name
    _name_hosts(cluster, names)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(operators.mpijob_hostfile(job))
    launcher = operators.mpijob_launcher(job, str(hostfile))
    env = {**_base_env(), **launcher.env}
    rsh = env["OMPI_MCA_plm_rsh_args"]
    no_stdin = "" if stdin else "-n "
    env["OMPI_MCA_plm_rsh_args"] = f"{no_stdin}-F {_ssh_config(cluster, names, tmp_path)} {rsh}"
    return cluster, launcher, env


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (Debian openmpi-bin)")
@pytest.mark.parametrize(
    ("secure", "slots", "stdin"),
    [(True, 1, False), (False, 2, True)],
    ids=["secure-1slot-no-stdin", "plain-2slots"],
)
def test_mpijob_trains_on_namespace_hosts(
    make_cluster: Any, tmp_path: Path, secure: bool, slots: int, stdin: bool
) -> None:
    """``no-stdin`` starts Open MPI's daemons with ``ssh -n`` (stdin at EOF from the start), as
    MPIJob v1's ``kubexec.sh`` does with ``kubectl exec`` without ``-i``: ranks must not care."""
    out = tmp_path / "out"
    out.mkdir()
    spec = describe(out, secure=secure, slots=slots, cpus=slots)
    docs = manifests.generate(spec, "mpijob", KEY if secure else None)
    secret = next((d for d in docs if d["kind"] == "Secret"), None)
    (job,) = [d for d in docs if d["kind"] == "MPIJob"]
    cluster, launcher, env = mpijob_on_hosts(make_cluster, job, tmp_path, stdin)
    with _secret_volume(secret, tmp_path) as volume:
        # The worker pods' container is sshd: /dev/shm and the key volume go into its mount
        # namespace, where the ranks mpirun starts over ssh look for them.
        for h in cluster.hosts[1:]:
            enter = ["nsenter", "-t", str(cluster.sshd_pid(h.name)), "-m", "--"]
            mounts = [_shm_mount(_dev_shm_bytes(job))]
            if volume is not None:
                mounts.append(["mount", "--bind", str(volume), manifests.KEY_DIR])
            for mount in mounts:
                subprocess.run([*enter, *mount], check=True, capture_output=True, timeout=30)
        _run(cluster, [(cluster.hosts[0].name, launcher.argv, env)], tmp_path / "logs")
    _check_reports(out, spec, "openmpi", {h.name for h in cluster.hosts[1:]})
